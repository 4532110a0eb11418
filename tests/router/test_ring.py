"""Router replicas that agree without talking (issue 38): consistent hashing with bounded loads (ring.py), prefix
keys equal in every process, the index's bound over all pods, and the kv-aware choice with replicas."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router.pool import KV_AWARE, LOAD_SLACK, Balancer, Pool, Target
from kvbridge_router.prefixes import CHUNK_TOKENS, PrefixIndex, prefix_keys
from kvbridge_router.ring import LOAD_FACTOR, Ring, anchor, cap

PODS = [f"prefill-{i}" for i in range(16)]
positions = st.integers(min_value=0, max_value=(1 << 64) - 1)


def test_keys_and_anchors_are_equal_in_every_process() -> None:
    """Replicas are separate processes, each with its own string hashing seed: text prompts must key alike."""
    program = (
        "from kvbridge_router.prefixes import prefix_keys; from kvbridge_router.ring import anchor, Ring;"
        "k = prefix_keys({'messages': [{'role': 'system', 'content': 'You are terse. ' * 40}]});"
        "s = prefix_keys({'prompt': 'x' * 400, 'cache_salt': 'tenant', 'tools': [{'type': 'function'}]});"
        "print(k[:3], anchor(k), next(iter(Ring(['a', 'b', 'c']).order(anchor(k)))), s[:2])"
    )
    printed = {
        subprocess.run(
            [sys.executable, "-c", program],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(printed) == 1, printed


@given(positions)
def test_the_ring_is_the_pods_set_in_any_order(position: int) -> None:
    assert list(Ring(PODS).order(position)) == list(Ring(reversed(PODS)).order(position))
    assert sorted(Ring(PODS).order(position)) == sorted(PODS)  # every pod, once


@given(positions, st.sampled_from(PODS))
def test_a_pod_leaving_moves_only_its_own_prompts(position: int, leaving: str) -> None:
    before = list(Ring(PODS).order(position))
    after = list(Ring([p for p in PODS if p != leaving]).order(position))
    assert after == [p for p in before if p != leaving]  # the others keep their order: to the next pod only


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=16), positions)
def test_bounded_loads_always_place_within_the_cap(loads: list[int], position: int) -> None:
    pods = PODS[: len(loads)]
    load = dict(zip(pods, loads, strict=True))
    limit = cap(sum(loads), len(pods))
    placed = Ring(pods).place(position, load, set(), limit)
    assert placed is not None  # the cap is above the average, so the least loaded pod is under it
    assert load[placed] + 1 <= limit <= max(1, -(-LOAD_FACTOR * (sum(loads) + 1) // len(pods)))
    first = next(iter(Ring(pods).order(position)))
    if load[first] + 1 <= limit:
        assert placed == first  # a prompt leaves its pod only when that pod is at the cap


def test_the_ring_shares_prompts_about_evenly() -> None:
    ring = Ring([f"prefill-{i}" for i in range(64)])
    counts: dict[str, int] = {}
    for number in range(20000):
        keys = prefix_keys({"prompt": list(range(number, number + 4 * CHUNK_TOKENS))})
        position = anchor(keys)
        assert position is not None
        pod = next(iter(ring.order(position)))
        counts[pod] = counts.get(pod, 0) + 1
    average = 20000 / 64
    assert len(counts) == 64
    assert max(counts.values()) < 1.6 * average
    assert min(counts.values()) > 0.5 * average


def test_a_prompt_is_anchored_by_its_first_chunks() -> None:
    head = list(range(4 * CHUNK_TOKENS))
    assert anchor(prefix_keys({"prompt": [*head, 1] * 1 + list(range(50))})) == anchor(prefix_keys({"prompt": head}))
    assert anchor([]) is None


def pool(prefills: int = 8, decodes: int = 2) -> Pool:
    return Pool(
        tuple(Target(f"p{i}", f"http://10.0.0.{i}:8000", "k") for i in range(prefills)),
        tuple(Target(f"d{i}", f"http://10.0.1.{i}:8000", "k") for i in range(decodes)),
    )


def test_replicas_that_never_talked_send_a_new_prefix_to_the_same_pod() -> None:
    routes = pool()
    for number in range(50):
        keys = prefix_keys({"prompt": list(range(number * 1000, number * 1000 + 6 * CHUNK_TOKENS))})
        chosen = {pair[0].pod for pair in (Balancer(replicas=4).choose(routes, keys=keys) for _ in range(4)) if pair}
        assert len(chosen) == 1
    # without the ring (each replica's least loaded, in turn) they need not agree
    first, second = Balancer(ring=False), Balancer(ring=False)
    first.choose(routes, keys=prefix_keys({"prompt": list(range(9 * CHUNK_TOKENS))}))
    keys = prefix_keys({"prompt": list(range(7, 7 + 9 * CHUNK_TOKENS))})
    one, two = first.choose(routes, keys=keys), second.choose(routes, keys=keys)
    assert one is not None
    assert two is not None
    assert one[0] != two[0]


def test_a_busy_home_pod_overflows_to_its_next_pod_on_the_ring() -> None:
    routes = pool()
    balancer = Balancer(policy=KV_AWARE)
    keys = prefix_keys({"prompt": list(range(6 * CHUNK_TOKENS))})
    position = anchor(keys)
    assert position is not None
    home, after = list(Ring(t.pod for t in routes.prefill).order(position))[:2]
    for _ in range(LOAD_SLACK + 1):
        balancer.started(home)
    pair = balancer.choose(routes, keys=keys)
    assert pair is not None
    assert pair[0].pod == after


def test_replicas_scale_their_own_counts() -> None:
    routes = pool(prefills=2)
    keys = prefix_keys({"prompt": list(range(6 * CHUNK_TOKENS))})
    for replicas, stays in ((1, True), (4, False)):
        balancer = Balancer(replicas=replicas)
        first = balancer.choose(routes, keys=keys)
        assert first is not None
        balancer.started(first[0].pod)  # one request of its own: 4 in all when 4 replicas share the pod
        again = balancer.choose(routes, keys=keys)
        assert again is not None
        assert (again[0] == first[0]) is stays


def test_the_index_keeps_max_keys_over_all_pods() -> None:
    index = PrefixIndex(keys_per_pod=64, max_keys=100)
    for pod in range(10):
        index.record(f"p{pod}", list(range(pod * 1000, pod * 1000 + 50)))
        assert index.size() <= 100
    assert index.limit() == 10
    assert index.matched("p9", list(range(9000, 9050))) == 10  # its leading keys are kept, the tail forgotten
    assert index.footprint() > 0


prompts = st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=6)


@settings(max_examples=200)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("record"), st.sampled_from(PODS[:4]), prompts),
            st.tuples(st.just("keep_only"), st.sampled_from(PODS[:4]), st.just([])),
        ),
        max_size=40,
    )
)
def test_only_the_holders_of_a_first_key_can_match(operations: list[tuple[str, str, list[int]]]) -> None:
    """A request scores only the pods holding its first key: no other pod may match any of it, after any records,
    evictions (a small bound) and pods leaving."""
    index = PrefixIndex(keys_per_pod=6, max_keys=12)
    seen: list[list[int]] = []
    for operation, pod, prompt in operations:
        keys = [hash((0, tuple(prompt[: i + 1]))) for i in range(len(prompt))]  # chained, as prefix_keys'
        if operation == "record":
            index.record(pod, keys)
            seen.append(keys)
        else:
            index.keep_only(p for p in PODS[:4] if p != pod)
        for keys in seen:
            for holder in PODS[:4]:
                if index.matched(holder, keys) > 0:
                    assert holder in index.holders(keys[0])
            for holder in index.holders(keys[0]):  # and every pod named still holds it: none kept after it left
                assert index.matched(holder, keys[:1]) == 1
    assert index.size() <= 12
