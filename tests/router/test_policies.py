"""The router's policies as units (issue 57 #2): one protocol, one module each, the choice returned as a value."""

from __future__ import annotations

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.policies import POLICIES, Choice
from kvbridge_router.policies.base import BY_LOAD, BY_PREFIX, BY_RING, BY_TURN
from kvbridge_router.pool import KV_AWARE, LEAST_LOADED, ROUND_ROBIN, Balancer, Pool
from kvbridge_router.prefixes import prefix_keys


def pool(prefills: int = 3, decodes: int = 2) -> Pool:
    def endpoint(pod: str) -> dict[str, object]:
        return {"pod": pod, "ip": "10.0.0.1", "httpPort": 8000, "pairing": "k"}

    return Pool.from_status(
        {
            "prefill": {"endpoints": [endpoint(f"p{i}") for i in range(prefills)]},
            "decode": {"endpoints": [endpoint(f"d{i}") for i in range(decodes)]},
        }
    )


def test_every_policy_is_registered_under_its_name() -> None:
    assert set(POLICIES) == set(RouterPolicy)
    for name, policy in POLICIES.items():
        assert policy.name == name
    assert [name for name, policy in POLICIES.items() if policy.scores_prefixes] == [RouterPolicy.KV_AWARE]


def test_round_robin_takes_turns_whatever_the_loads() -> None:
    balancer, routes = Balancer(policy=ROUND_ROBIN), pool()
    balancer.started("p0")
    balancer.started("p0")  # least-loaded would avoid p0: round-robin does not
    choices = [balancer.decide(routes) for _ in range(6)]
    assert [c.prefill.pod for c in choices if c] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert {c.reason for c in choices if c} == {BY_TURN}
    assert {c.decode.pod for c in choices if c} == {"d0", "d1"}


def test_round_robin_skips_the_pods_that_failed_the_request() -> None:
    balancer, routes = Balancer(policy=ROUND_ROBIN), pool()
    picks = [balancer.decide(routes, exclude=["p1"]) for _ in range(4)]
    assert [c.prefill.pod for c in picks if c] == ["p0", "p2", "p0", "p2"]
    assert balancer.decide(routes, exclude=["p0", "p1", "p2"]) is None
    only = balancer.decide(routes, exclude_decodes=["d0"])
    assert only is not None
    assert only.decode.pod == "d1"


def test_the_choice_is_a_value_saying_why() -> None:
    keys = prefix_keys({"prompt": list(range(4 * 16))})
    balancer, routes = Balancer(policy=KV_AWARE), pool()
    first = balancer.decide(routes, keys=keys)
    assert isinstance(first, Choice)
    assert (first.reason, first.matched, first.ticks) == (BY_RING, 0, ())
    assert first.tick > 0
    balancer.prefilled(first.prefill.pod, first.tick, keys, first.matched, computed=True)
    again = balancer.decide(routes, keys=keys)
    assert again is not None
    assert again.prefill == first.prefill
    assert (again.reason, again.matched, len(again.ticks)) == (BY_PREFIX, len(keys), len(keys))
    assert again != first  # a value: the first choice is as it was
    loaded = Balancer(policy=LEAST_LOADED).decide(routes, keys=keys)
    assert loaded is not None
    assert (loaded.reason, loaded.matched, loaded.tick) == (BY_LOAD, 0, 0)


def test_a_policy_changed_by_name_is_used_at_the_next_choice() -> None:
    balancer, routes = Balancer(), pool()
    balancer.started("p0")
    balancer.policy = ROUND_ROBIN
    choice = balancer.decide(routes)
    assert choice is not None
    assert (choice.prefill.pod, choice.reason) == ("p0", BY_TURN)
