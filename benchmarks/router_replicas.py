"""The kv-aware policy with several router replicas and hundreds of prefill pods, in a simulated pool (not a test).

    .venv/bin/python benchmarks/router_replicas.py --pods 256 [--replicas 1 2 4] [--requests 40000]
        [--policies least-loaded memory ring kv-aware] [--capacity-blocks 4096] [--json]

No engine runs: the router's own :class:`~kvbridge_router.pool.Balancer` objects choose, one per router replica, and
each request goes to a replica drawn at random (a Service spreading connections). The pool is simulated:

- ``--pods`` prefill pods (and a quarter as many decode pods, all of one pairing key), each a FIFO server whose
  prefill takes ``--overhead-ms`` plus ``--ms-per-block`` per KV block it does not hold (a block of
  ``--block-tokens`` tokens), and whose KV cache holds ``--capacity-blocks`` blocks, evicting the least recently
  used: a request hits the leading blocks of its prompt the pod holds, as vLLM's prefix cache does;
- ``--prefixes`` distinct prefixes (10^5), drawn by a Zipf law of exponent ``--zipf``, each of a lognormal length
  (median ``--prefix-tokens``), most beginning with one of ``--system-prompts`` shared system prompts (median
  ``--system-tokens``): documents or conversations behind an agent's instructions; each request adds a
  question of its own (lognormal, median ``--suffix-tokens``). Poisson arrivals at ``--rate-per-pod`` per pod.

Each replica is told, with each prefill pod's answer, how many leading blocks of the prompt the pod's cache held
(vLLM's ``remote_prefill_cached_tokens``), and forgets what that pod evicted (``Balancer.observed``); ``--blind``:
not. Each replica is told the replica count (``kvbridge-router --replicas``, what the operator passes) and scales its
counts of requests in flight by it; ``--unscaled``: not (every router as before). Policies: ``least-loaded``;
``memory``: kv-aware as it was, each replica preferring the pods it sent the prompt's prefix, else the least loaded;
``ring``: consistent hashing with bounded loads only (ring.py; no memory); ``kv-aware``: memory first, else the ring
(what the router runs). Reported per policy and replica count: the pods' prefix-cache hit rate (blocks hit / blocks
asked), and as a fraction of the ideal (an unbounded cache shared by all: a request hits its whole prefix when that
was asked before, else its system prompt when that was) and of one replica's; the pods a prefix was computed on (its
copies); simulated TTFT p50 and p99 (queueing and prefill) and its ratio to one replica's; the router's CPU per
request (thread CPU time, so that other processes on the machine do not count; the choice: ``Balancer.choose`` with
its bookkeeping, and the prompt's keys, ``prefix_keys``, of a text prompt of the request's length); the index's keys
and bytes per router.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvbridge_router.pool import KV_AWARE, LEAST_LOADED, Balancer, Pool, Target
from kvbridge_router.prefixes import BYTES_PER_TOKEN, PrefixIndex, prefix_keys

POLICIES = ("least-loaded", "memory", "ring", "kv-aware")


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class NoMemory(PrefixIndex):
    """An index that remembers nothing: the ``ring`` policy (consistent hashing with bounded loads alone)."""

    def matched(self, pod: str, keys: list[int]) -> int:
        return 0

    def record(self, pod: str, keys: list[int], *, later: bool = False) -> int:
        return 0  # no record: no tick


def balancer(policy: str, replicas: int) -> Balancer:
    if policy == "least-loaded":
        return Balancer(policy=LEAST_LOADED, replicas=replicas)
    if policy == "memory":
        return Balancer(policy=KV_AWARE, ring=False, replicas=replicas)
    if policy == "ring":
        return Balancer(policy=KV_AWARE, ring=True, prefixes=NoMemory(), replicas=replicas)
    return Balancer(policy=KV_AWARE, ring=True, replicas=replicas)


@dataclass
class Request:
    arrival: float
    keys: list[int]
    prefix_blocks: int  # the blocks of its prefix (the ideal hits, once the prefix was seen)
    prefix: int
    system: int  # its system prompt (-1: none)
    system_blocks: int  # the blocks of it (the ideal hits, once another prefix with it was seen)
    tokens: int


@dataclass
class Workload:
    requests: list[Request]
    distinct_prefix_blocks: int


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


def workload(args: argparse.Namespace, pods: int) -> Workload:
    rng = random.Random(args.seed)
    block = args.block_tokens
    systems = [lognormal(rng, args.system_tokens, 0.5, 32, 4096) for _ in range(args.system_prompts)]
    # each prefix: a system prompt (or none, 1 in 5) and a body of its own
    shapes = [
        (
            rng.randrange(args.system_prompts) if rng.random() < 0.8 else -1,
            lognormal(rng, args.prefix_tokens, 0.8, 64, 16384),
        )
        for _ in range(args.prefixes)
    ]
    weights = list(itertools.accumulate(1 / (rank + 1) ** args.zipf for rank in range(args.prefixes)))
    rate = args.rate_per_pod * pods
    now = 0.0
    requests = []
    seen: set[int] = set()
    distinct = 0
    for number in range(args.requests):
        now += rng.expovariate(rate)
        prefix = bisect.bisect_left(weights, rng.random() * weights[-1])
        system, body = shapes[prefix]
        system_tokens = systems[system] if system >= 0 else 0
        suffix = lognormal(rng, args.suffix_tokens, 0.8, 8, 4096)
        tokens = system_tokens + body + suffix
        keys: list[int] = []
        key = 0
        for index in range(tokens // block):
            end = (index + 1) * block
            if end <= system_tokens:
                part: tuple[int, ...] = (1, system, index)  # the system prompt's blocks, shared by its prefixes
            elif end <= system_tokens + body:
                part = (2, prefix, index)
            else:
                part = (3, number, index)  # the request's own question (or the block it begins in)
            key = hash((key, part))
            keys.append(key)
        prefix_blocks = (system_tokens + body) // block
        if prefix not in seen:
            seen.add(prefix)
            distinct += prefix_blocks
        requests.append(Request(now, keys, prefix_blocks, prefix, system, system_tokens // block, tokens))
    return Workload(requests, distinct)


class KVCache:
    """A pod's prefix cache: ``capacity`` blocks, least recently used evicted first; a request's blocks are used
    tail first, as vLLM frees them (so that its prefix stays longest)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefill(self, keys: list[int]) -> int:
        hit = 0
        for key in keys:
            if key not in self.blocks:
                break
            hit += 1
        for key in reversed(keys):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


@dataclass
class Result:
    policy: str
    replicas: int
    hit_rate: float
    ideal_hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    choose_us: float
    keys_us: float
    index_keys: int
    index_mib: float
    pods_used_per_prefix: float
    #: the prefill pods' busy time over their time (all pods, the whole run)
    utilization: float
    #: of the leading blocks the routers believed the chosen pod held, the share it did not (evicted): their view's
    #: error
    believed_not_held: float


def index_bytes(index: PrefixIndex) -> int:
    return index.footprint()


def simulate(args: argparse.Namespace, load: Workload, pods: int, policy: str, replicas: int) -> Result:
    rng = random.Random(args.seed + 1)
    prefill = tuple(Target(f"prefill-{i}", f"http://10.0.{i // 250}.{i % 250}:8000", "k") for i in range(pods))
    decode = tuple(
        Target(f"decode-{i}", f"http://10.1.{i // 250}.{i % 250}:8000", "k") for i in range(max(1, pods // 4))
    )
    pool = Pool(prefill, decode)
    sharing = bool(args.share_ms) and replicas > 1
    routers = [balancer(policy, 1 if args.unscaled else replicas) for _ in range(replicas)]
    if sharing and args.share in ("sent", "both"):
        for router in routers:
            router.sent = []  # what it sent, for its next report (the router's own bookkeeping, peering.py)
    shared_at = 0.0
    caches = {t.pod: KVCache(args.capacity_blocks) for t in prefill}
    busy_until = dict.fromkeys(caches, 0.0)
    in_flight: list[tuple[float, int, str, str]] = []
    ttfts: list[float] = []
    hits = asked = ideal = 0
    seen: set[int] = set()
    systems: set[int] = set()
    homes: dict[int, set[str]] = {}
    choose_ns = 0
    busy = 0.0
    believed = wrong = 0
    for request in load.requests:
        while in_flight and in_flight[0][0] <= request.arrival:
            _, replica, p, d = heapq.heappop(in_flight)
            routers[replica].finished(p)
            routers[replica].finished(d)
        if sharing and request.arrival >= shared_at + args.share_ms / 1000:
            shared_at = request.arrival
            if args.share in ("loads", "both"):
                tell(routers)
            if args.share in ("sent", "both"):
                for router in routers:
                    sent, _ = router.drain_sent()
                    for other in routers:
                        if other is not router:
                            for pod, keys in sent:
                                other.prefixes.record(pod, keys)
        replica = rng.randrange(replicas)
        router = routers[replica]
        started = time.thread_time_ns()
        chosen = router.choose(pool, keys=request.keys)
        if chosen is None:
            raise RuntimeError("the simulated pool has no pair")
        router.started(chosen[0].pod)
        router.started(chosen[1].pod)
        choose_ns += time.thread_time_ns() - started
        pod = chosen[0].pod
        hit = caches[pod].prefill(request.keys)
        router.prefilled(pod, router.last_tick, request.keys, router.last_matched, computed=True)
        believed += router.last_matched if router.last_ticks else 0
        wrong += max(0, router.last_matched - hit) if router.last_ticks else 0
        if not args.blind and router.last_ticks:  # the pod's answer says what it held (remote_prefill_cached_tokens)
            router.observed(pod, router.last_ticks, hit)
        hits += hit
        asked += len(request.keys)
        if request.prefix in seen:
            ideal += request.prefix_blocks
        elif request.system in systems:
            ideal += request.system_blocks
        seen.add(request.prefix)
        systems.add(request.system)
        homes.setdefault(request.prefix, set()).add(pod)
        begin = max(request.arrival, busy_until[pod])
        finish = begin + (args.overhead_ms + args.ms_per_block * (len(request.keys) - hit)) / 1000
        busy_until[pod] = finish
        busy += finish - begin
        ttfts.append(finish - request.arrival)
        heapq.heappush(in_flight, (finish, replica, pod, chosen[1].pod))
    ttfts.sort()
    repeated = [len(h) for prefix, h in homes.items() if len(h) > 0]
    return Result(
        policy=policy,
        replicas=replicas,
        hit_rate=hits / asked,
        ideal_hit_rate=ideal / asked,
        ttft_p50_ms=1000 * ttfts[len(ttfts) // 2],
        ttft_p99_ms=1000 * ttfts[int(len(ttfts) * 0.99)],
        choose_us=choose_ns / len(load.requests) / 1000,
        keys_us=0.0,
        index_keys=max(r.prefixes.size() for r in routers),
        index_mib=max(index_bytes(r.prefixes) for r in routers) / 2**20,
        pods_used_per_prefix=statistics.fmean(repeated),
        utilization=busy / (pods * max(busy_until.values())),
        believed_not_held=wrong / max(believed, 1),
    )


def tell(routers: list[Balancer]) -> None:
    """Every replica is told the others' requests in flight per pod as they are now (``--share-ms``, a report from
    each replica to the others, none lost or late here), as the router's reports tell it (``Balancer.set_peers``)."""
    for router in routers:
        others: dict[str, int] = {}
        for other in routers:
            if other is not router:
                for pod, count in other.outstanding.items():
                    others[pod] = others.get(pod, 0) + count
        router.set_peers(others, heard=len(routers) - 1)


def keys_cost(args: argparse.Namespace, load: Workload, samples: int = 2000) -> float:
    """Microseconds per request for ``prefix_keys`` of a text prompt of the request's length."""
    rng = random.Random(args.seed + 2)
    letters = "abcdefghijklmnopqrstuvwxyz      "
    bodies = [
        {"prompt": "".join(rng.choices(letters, k=r.tokens * BYTES_PER_TOKEN))}
        for r in rng.sample(load.requests, min(samples, len(load.requests)))
    ]
    started = time.thread_time_ns()
    for body in bodies:
        prefix_keys(body, args.block_tokens)
    return (time.thread_time_ns() - started) / len(bodies) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--requests", type=int, default=40000)
    parser.add_argument("--prefixes", type=int, default=100_000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--system-prompts", type=int, default=200)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--suffix-tokens", type=int, default=150)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--capacity-blocks", type=int, default=4096)
    parser.add_argument("--rate-per-pod", type=float, default=2.5)
    parser.add_argument("--overhead-ms", type=float, default=2.5)
    parser.add_argument("--ms-per-block", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--blind",
        action="store_true",
        help="routers are not told what the pods' caches held of each prompt (as before the router read it from "
        "prefill's answers): what a pod evicted stays in their view",
    )
    parser.add_argument(
        "--unscaled", action="store_true", help="replicas count their own requests only (--replicas=1 each, as before)"
    )
    parser.add_argument(
        "--share-ms",
        type=float,
        default=0.0,
        help="replicas report to each other this often (kvbridge-router --peer-interval; 0: no reports)",
    )
    parser.add_argument(
        "--share",
        choices=("loads", "sent", "both"),
        default="both",
        help="what a report holds: requests in flight per pod, what was sent where, or both (as the router)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    for pods in args.pods:
        load = workload(args, pods)
        keys_us = keys_cost(args, load)
        capacity = pods * args.capacity_blocks
        progress(
            f"{pods} pods: {len(load.requests)} requests, {len({r.prefix for r in load.requests})} prefixes used, "
            f"their blocks {load.distinct_prefix_blocks / capacity:.1f}x the pool's KV capacity; "
            f"prefix_keys {keys_us:.1f} us/request"
        )
        for policy in args.policies:
            one: Result | None = None
            for replicas in args.replicas:
                began = time.monotonic()
                result = simulate(args, load, pods, policy, replicas)
                result.keys_us = keys_us
                one = one or result
                row = {
                    "pods": pods,
                    **result.__dict__,
                    "of_ideal": result.hit_rate / result.ideal_hit_rate,
                    "hit_vs_one": result.hit_rate / one.hit_rate,
                    "ttft_p50_vs_one": result.ttft_p50_ms / one.ttft_p50_ms,
                }
                results.append(row)
                progress(
                    f"  {policy:>12} R={replicas}: hit {result.hit_rate:.3f} ({row['of_ideal']:.2f} of ideal, "
                    f"{row['hit_vs_one']:.2f}x R=1), TTFT p50 {result.ttft_p50_ms:.0f} ms "
                    f"({row['ttft_p50_vs_one']:.2f}x) p99 {result.ttft_p99_ms:.0f} ms, "
                    f"choose {result.choose_us:.0f} us, "
                    f"pods/prefix {result.pods_used_per_prefix:.2f}, busy {result.utilization:.2f}, "
                    f"index {result.index_keys} keys "
                    f"{result.index_mib:.0f} MiB ({time.monotonic() - began:.0f} s)"
                )
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(
            "| pods | policy | R | hit rate | of ideal | vs R=1 | pods/prefix | TTFT p50 ms | vs R=1 | p99 ms "
            "| choose µs | keys µs | index keys | index MiB | believed, not held |"
        )
        print("|---" * 15 + "|")
        for r in results:
            print(
                f"| {r['pods']} | {r['policy']} | {r['replicas']} | {r['hit_rate']:.3f} | {r['of_ideal']:.2f} | "
                f"{r['hit_vs_one']:.2f} | {r['pods_used_per_prefix']:.2f} | {r['ttft_p50_ms']:.0f} | "
                f"{r['ttft_p50_vs_one']:.2f} | {r['ttft_p99_ms']:.0f} | {r['choose_us']:.0f} | {r['keys_us']:.0f} | "
                f"{r['index_keys']} | {r['index_mib']:.0f} | {r['believed_not_held']:.3f} |"
            )


if __name__ == "__main__":
    main()
