"""Benchmark of the pure core's hot and warm paths (not a test: prints medians, asserts nothing).

    make bench-core            # or: .venv/bin/python benchmarks/core_plan.py [--json]

- per request: block ids -> descriptor ids for 160 regions (an 80-layer Split
  model) and a 2048-block request, with and without a block-size ratio;
- per remote engine: plan construction for an 80-layer model (compatibility
  rules, wire format, TP mapping for every decode rank) and the descriptor
  address table of one peer (160 regions x 16384 blocks).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvbridge_agent.core import (
    ModelGeometry,
    RoleSettings,
    build_plan,
    descriptor_ids,
    map_request_blocks,
    region_layout,
    unit_addresses,
)


def median_us(fn: Callable[[], object], repeats: int, inner: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    model = ModelGeometry(name="llama-70b-like", num_layers=80, num_kv_heads=8, head_dim=128)
    rng = np.random.default_rng(0)
    num_blocks = 16384
    request = rng.choice(num_blocks, size=2048, replace=False).astype(np.int64)
    remote = rng.choice(num_blocks, size=2048, replace=False).astype(np.int64)
    half_remote = np.arange(4096, dtype=np.int64)
    regions = 2 * model.num_layers
    layout = region_layout(model, 16, 4)
    bases = [i * (1 << 30) for i in range(layout.num_tensors)]

    local_out = np.empty(regions * 2 * 2048, dtype=np.int32)
    remote_out = np.empty(regions * 2 * 2048, dtype=np.int32)

    def map_and_ids(out: bool) -> object:
        mapped = map_request_blocks(request, remote, 1)
        return (
            descriptor_ids(mapped.local, regions, num_blocks, out=local_out if out else None),
            descriptor_ids(mapped.remote, regions, num_blocks, out=remote_out if out else None),
        )

    cases: list[tuple[str, Callable[[], object], int]] = [
        ("descriptor ids, 160 regions x 2048 blocks", lambda: descriptor_ids(request, regions, num_blocks), 20),
        (
            "descriptor ids into a reused buffer, 160 regions x 2048 blocks",
            lambda: descriptor_ids(request, regions, num_blocks, out=local_out),
            20,
        ),
        ("map + local and remote descriptor ids, 2048 blocks (fresh arrays)", lambda: map_and_ids(False), 10),
        ("map + local and remote descriptor ids, 2048 blocks (reused buffers)", lambda: map_and_ids(True), 10),
        (
            "map with block-size ratio 2 + descriptor ids (reused buffer), 2048 local blocks",
            lambda: descriptor_ids(
                map_request_blocks(request, half_remote, 2).local, regions, 2 * num_blocks, out=local_out
            ),
            10,
        ),
        (
            "plan construction, 80 layers, TP 4 -> 2, both decode ranks",
            lambda: (
                build_plan(model, RoleSettings(tensor_parallel_size=4), RoleSettings(tensor_parallel_size=2)).all_ranks
            ),
            5,
        ),
        (
            "plan construction, 80 layers, TP 8 -> 1 with block split and permute",
            lambda: (
                build_plan(
                    model,
                    RoleSettings.model_validate({"tensorParallelSize": 8, "blockSize": 32, "kvLayout": "NHD"}),
                    RoleSettings(tensor_parallel_size=1),
                ).all_ranks
            ),
            5,
        ),
        (
            "descriptor address table of one peer, 160 regions x 16384 blocks",
            lambda: unit_addresses(bases, layout, num_blocks),
            3,
        ),
    ]
    results = []
    for name, fn, inner in cases:
        print(f"  measuring: {name} ...", file=sys.stderr, flush=True)
        results.append({"name": name, "medianMicroseconds": round(median_us(fn, args.repeats, inner), 1)})
    machine = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine()}
    if args.json:
        print(json.dumps({"machine": machine, "results": results}, indent=2))
    else:
        print(f"kvbridge core benchmark (median of {args.repeats} runs; {machine})")
        for row in results:
            print(f"  {row['medianMicroseconds']:>10.1f} us  {row['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
