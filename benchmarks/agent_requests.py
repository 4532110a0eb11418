"""Per-request figures of the agent through real engine processes (not a test).

    .venv/bin/python benchmarks/agent_requests.py [--json] [--requests 5] [--blocks 1000]

Starts a prefill and a decode engine (TP 1 each, ``kvbridge-agent serve``
processes with real NIXL and the real side channel) for an 80-layer model
with one KV head per rank and head_dim 128 in bfloat16 (Llama-3-70B at TP 8:
4 KiB per region block), once with the Split cache kind (160 regions) and
once with CrossLayer (one region), and sends ``--requests`` requests of
``--blocks`` blocks each with synthetic content and verification off.
Reports medians of: transfer throughput (READs posted to completion),
descriptors per request, kvbridge's own per-request CPU time (block ids ->
descriptor ids) and the time until every READ is posted (ids + NIXL's
``make_prepped_xfer`` and post), and the handshake time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from kvbridge_agent.core import ModelGeometry, RoleSettings
from kvbridge_agent.runtime.bench import measure_pair
from kvbridge_agent.runtime.keys import generate_keys


def run(kind: str, blocks: int, requests: int, keys_dir: str) -> dict[str, object]:
    model = ModelGeometry(name="bench-80l", num_layers=80, num_kv_heads=1, head_dim=128, cache_kind=kind)
    rows, handshake = measure_pair(
        kind, model, RoleSettings(), RoleSettings(), tokens=blocks * 16, requests=requests, keys_dir=keys_dir,
        num_blocks=blocks + 16,
    )  # fmt: skip
    seconds = statistics.median(r["transferSeconds"] for r in rows)
    return {
        "cacheKind": kind,
        "blocksPerRequest": blocks,
        "bytesPerRequest": rows[0]["bytes"],
        "descriptorsPerRequest": rows[0]["descriptors"],
        "gbps": round(rows[0]["bytes"] / seconds / 1e9, 3),
        "transferMs": round(seconds * 1e3, 2),
        "idsUs": round(statistics.median(r["idsMicroseconds"] for r in rows), 1),
        "makeUs": round(statistics.median(r["makeMicroseconds"] for r in rows), 1),
        "postUs": round(statistics.median(r["postMicroseconds"] for r in rows), 1),
        "handshakeMs": round(handshake * 1e3, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as keys_dir:
        generate_keys(keys_dir)
        results = [run(kind, args.blocks, args.requests, keys_dir) for kind in ("Split", "CrossLayer")]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for row in results:
            print(
                f"{row['cacheKind']:>10}: {row['gbps']} GB/s ({row['transferMs']} ms for {row['bytesPerRequest']} "
                f"bytes), {row['descriptorsPerRequest']} descriptors, ids {row['idsUs']} us, make_prepped_xfer "
                f"{row['makeUs']} us, posted after "
                f"{row['postUs']} us, handshake {row['handshakeMs']} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
