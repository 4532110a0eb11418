"""The router's pairing and balancing, from a status as the operator writes it."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router.pool import KV_AWARE, LOAD_SLACK, Balancer, Pool, Target
from kvbridge_router.prefixes import prefix_keys
from kvbridge_router.proxy import Router
from kvbridge_router.ring import Ring, anchor, cap

PODS6 = tuple(f"pod-{i}" for i in range(6))


def endpoint(pod: str, key: str, ip: str = "10.0.0.1", port: int | None = 8000) -> dict[str, Any]:
    found: dict[str, Any] = {"pod": pod, "ip": ip, "pairing": key, "revision": "r"}
    if port is not None:
        found["httpPort"] = port
    return found


def status(prefill: list[dict[str, Any]], decode: list[dict[str, Any]], pairings: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prefill": {"endpoints": prefill}, "decode": {"endpoints": decode}}
    if pairings is not None:
        out["rollout"] = {"pairings": [{"prefill": p, "decode": d} for p, d in pairings]}
    return out


def test_only_equal_or_listed_keys_pair() -> None:
    pool = Pool.from_status(
        status(
            [endpoint("p-old", "aaa"), endpoint("p-new", "bbb"), endpoint("p-other", "ccc")],
            [endpoint("d-old", "aaa"), endpoint("d-new", "bbb")],
            pairings=[("bbb", "aaa")],  # the operator checked new prefill -> old decode, not old prefill -> new decode
        )
    )
    by_name = {t.pod: t for t in pool.prefill}
    assert [d.pod for d in pool.decodes_for(by_name["p-old"])] == ["d-old"]
    assert [d.pod for d in pool.decodes_for(by_name["p-new"])] == ["d-new", "d-old"]  # sorted by name
    assert pool.decodes_for(by_name["p-other"]) == ()
    assert [t.pod for t in pool.routable()] == ["p-new", "p-old"]


def test_endpoints_without_a_port_or_key_are_skipped_and_said() -> None:
    pool = Pool.from_status(status([endpoint("p0", "k", port=None), endpoint("p1", "")], [endpoint("d0", "k")]))
    assert pool.prefill == ()
    assert pool.skipped == ("prefill p0: no HTTP port", "prefill p1: no pairing key")
    assert pool.problem() == "no ready prefill endpoint in the deployment's status"


def test_urls_bracket_ipv6() -> None:
    pool = Pool.from_status(status([endpoint("p0", "k", ip="fd00::1")], [endpoint("d0", "k", port=9000)]))
    assert pool.prefill[0].url == "http://[fd00::1]:8000"
    assert pool.decode[0].url == "http://10.0.0.1:9000"


def test_a_pool_of_different_keys_says_why_it_routes_nothing() -> None:
    pool = Pool.from_status(status([endpoint("p0", "a")], [endpoint("d0", "b")]))
    assert Balancer().choose(pool) is None
    assert "pairing key" in pool.problem()
    assert Pool.from_status({}).problem() == "no ready prefill and decode endpoint in the deployment's status"


def test_idle_pods_take_turns_and_busy_ones_are_avoided() -> None:
    pool = Pool.from_status(status([endpoint(f"p{i}", "k") for i in range(3)], [endpoint("d0", "k")]))
    balancer = Balancer()
    picks = [balancer.choose(pool) for _ in range(6)]
    assert sorted(p[0].pod for p in picks if p) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    balancer.started("p0")
    balancer.started("p1")
    assert {balancer.choose(pool)[0].pod for _ in range(4)} == {"p2"}  # type: ignore[index]
    balancer.finished("p0")
    balancer.finished("p1")
    balancer.finished("p1")  # never below zero
    assert balancer.outstanding == {}


def test_two_idle_prefill_pods_alternate_though_decode_is_picked_between() -> None:
    pool = Pool.from_status(status([endpoint("p0", "k"), endpoint("p1", "k")], [endpoint("d0", "k")]))
    balancer = Balancer()
    picks = [balancer.choose(pool) for _ in range(4)]
    assert [p[0].pod for p in picks if p] == ["p0", "p1", "p0", "p1"]


def test_excluded_pods_are_not_chosen() -> None:
    pool = Pool.from_status(status([endpoint("p0", "k"), endpoint("p1", "k")], [endpoint("d0", "k")]))
    balancer = Balancer()
    assert {balancer.choose(pool, exclude=["p0"])[0].pod for _ in range(4)} == {"p1"}  # type: ignore[index]
    assert balancer.choose(pool, exclude=["p0", "p1"]) is None


@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from("abc")), max_size=6),
    st.lists(st.sampled_from("abc"), min_size=1, max_size=5),
    st.lists(st.sampled_from("abc"), min_size=1, max_size=5),
)
def test_every_chosen_pair_is_equal_or_listed(
    pairings: list[tuple[str, str]], prefill: list[str], decode: list[str]
) -> None:
    pool = Pool.from_status(
        status(
            [endpoint(f"p{i}", k) for i, k in enumerate(prefill)],
            [endpoint(f"d{i}", k) for i, k in enumerate(decode)],
            pairings,
        )
    )
    balancer = Balancer()
    allowed = set(pairings)
    for _ in range(10):
        pair = balancer.choose(pool)
        if pair is None:
            assert not any(p == d or (p, d) in allowed for p in prefill for d in decode)
            break
        assert pair[0].pairing == pair[1].pairing or (pair[0].pairing, pair[1].pairing) in allowed
        balancer.started(pair[0].pod)


def test_a_pod_restarted_or_replaced_under_its_name_is_forgotten_by_the_router() -> None:
    """The status' incarnation (uid:restarts) of a pod changes when it restarts or is replaced: the router forgets
    what it sent that pod, whose cache is empty, and keeps what it sent the others."""

    def pool(first: str, second: str) -> Pool:
        prefill = [endpoint("p0", "k") | {"incarnation": first}, endpoint("p1", "k") | {"incarnation": second}]
        return Pool.from_status(status(prefill, [endpoint("d0", "k") | {"incarnation": "d:0"}]))

    router = Router()
    router.set_pool(pool("uid-a:0", "uid-b:0"))
    for pod in ("p0", "p1", "d0"):
        router.balancer.prefixes.record(pod, [1, 2, 3])
    router.set_pool(pool("uid-a:0", "uid-b:0"))  # the same pods: nothing forgotten
    assert [router.balancer.prefixes.matched(pod, [1, 2, 3]) for pod in ("p0", "p1", "d0")] == [3, 3, 3]
    router.set_pool(pool("uid-a:1", "uid-c:0"))  # p0's container restarted; p1 replaced under its name
    assert [router.balancer.prefixes.matched(pod, [1, 2, 3]) for pod in ("p0", "p1", "d0")] == [0, 0, 3]
    assert pool("", "uid-b:0").reborn(pool("uid-a:0", "uid-b:0")) == set()  # unknown is not another


def expected_picks(
    balancer: Balancer, every: tuple[Target, ...], exclude: list[str], keys: list[int] | None
) -> set[str] | None:
    """The pods a pick may return, by the policy's words alone (a Python loop over every candidate), None for none."""
    options = [t for t in every if t.pod not in exclude]
    if not options:
        return None
    loads = {t.pod: balancer.outstanding.get(t.pod, 0) * balancer.replicas for t in options}
    fewest = min(loads.values())
    if keys and balancer.policy == KV_AWARE:
        scores = {t.pod: balancer.prefixes.matched(t.pod, keys) for t in options if loads[t.pod] <= fewest + LOAD_SLACK}
        best = max(scores.values(), default=0)
        if best > 0:
            matching = [pod for pod, score in scores.items() if score == best]
            least = min(loads[pod] for pod in matching)
            return {pod for pod in matching if loads[pod] == least}
        position = anchor(keys)
        if balancer.ring and position is not None:
            limit = math.ceil(cap(sum(loads.values()), len(options), slack=LOAD_SLACK) / balancer.replicas)
            placed = Ring(t.pod for t in every).place(position, balancer.outstanding, set(exclude), limit)
            if placed is not None:
                return {placed}
    return {pod for pod, load in loads.items() if load == fewest}


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(
        st.tuples(
            st.sampled_from(["pick", "start", "finish", "keep"]),
            st.lists(st.sampled_from(PODS6), max_size=4),
            st.lists(st.integers(0, 2), max_size=5),
        ),
        max_size=40,
    ),
)
def test_a_pick_is_what_the_policy_says_after_any_history(
    replicas: int, operations: list[tuple[str, list[str], list[int]]]
) -> None:
    """The array-based choice (slots, the first-key holders, cached rings) picks what the policy's plain loop would,
    after any mix of requests started and finished, prompts recorded, pods excluded and pools changed."""
    balancer = Balancer(replicas=replicas)
    every = tuple(Target(pod, f"http://{pod}", "k") for pod in PODS6)
    for operation, pods, chunks in operations:
        keys = prefix_keys({"prompt": [token for chunk in chunks for token in [chunk] * 16]}) if chunks else None
        if operation == "start":  # loads that cross the slack within a few operations
            for pod in pods * 2:
                balancer.started(pod)
        elif operation == "finish":
            for pod in pods:
                balancer.finished(pod)
        elif operation == "keep":  # a new pool: the listed pods (and those with requests in flight) keep their slots
            balancer.keep_only(pods)
            every = tuple(Target(pod, f"http://{pod}", "k") for pod in PODS6)  # another tuple, as a new pool's
        else:
            allowed = expected_picks(balancer, every, pods, keys)
            picked = balancer.pick(every, pods, keys)
            assert (picked is None) if allowed is None else (picked is not None and picked.pod in allowed)
            if picked is not None and keys:
                balancer.prefixes.record(picked.pod, keys)
    assert all(count > 0 for count in balancer.outstanding.values())


def test_among_hundreds_of_pods_the_one_idle_pod_is_picked_and_a_finished_pod_is_idle_again() -> None:
    """Only pods with requests in flight are read per choice: the one idle pod among 200 is found, whatever its
    place, and pods whose requests all ended count as idle again."""
    balancer = Balancer()
    pods = tuple(Target(f"pod-{i:03d}", f"http://pod-{i}", "k") for i in range(200))
    for target in pods[1:]:
        balancer.started(target.pod)
    assert balancer.pick(pods) == pods[0]  # the one idle pod
    balancer.started(pods[0].pod)
    balancer.finished(pods[150].pod)
    assert balancer.pick(pods) == pods[150]
    assert balancer.pick(pods, exclude=[pods[150].pod]) in pods  # every other one as busy: the least loaded
    for target in pods:
        balancer.finished(target.pod)
    assert balancer.outstanding == {}
    assert balancer.load_of(pods[1].pod) == 0
