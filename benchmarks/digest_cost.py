"""What verifying a transfer costs (core.digest, kvbridge-digest/2): the digest on prefill (after compute, before
any reader) and on decode (after the READs and conversions), against the transfer it verifies, measured in one run.

    .venv/bin/python benchmarks/digest_cost.py [--tokens 128 512 2048] [--repeats 5] [--before REV [--rounds 3]]

Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per token), one prefill and one
decode rank in this process with real NIXL agents on DRAM, 16-token blocks, requests of 128 to 2,048 tokens;
each row is the median of ``--repeats`` requests, each request under its own key.

``--before REV`` measures the digest of git revision REV too (its agent sources and its own copy of this script,
extracted with ``git archive``), each revision in its own process, taking turns (``--rounds``) so that both meet
the same noise; it reports, per size, the median over the rounds of each revision's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
BLOCK = 16
FIGURES = ("read_ms", "prefill_digest_ms", "decode_digest_ms", "decode_digest_vs_read", "prefill_digest_vs_read")


def measure(tokens_list: list[int], repeats: int) -> None:
    """This checkout's digest against the READ, one JSON row per size."""
    import torch

    from kvbridge_agent.core import CacheKind, KVLayout, ModelGeometry, RoleSettings, TransferSettings, build_plan
    from kvbridge_agent.core.blocks import blocks_for_tokens, wire_block_ids
    from kvbridge_agent.core.digest import RequestDigests, new_key
    from kvbridge_agent.core.handshake import KVTransferParams
    from kvbridge_agent.transfer.decode_rank import DecodeRank
    from kvbridge_agent.transfer.kv_cache import KVCache
    from kvbridge_agent.transfer.prefill_rank import PrefillRank
    from kvbridge_agent.transfer.reads import ReadResult, Verify
    from kvbridge_agent.transfer.transport import Transport

    model = ModelGeometry(
        name="llama3-8b-geometry", num_layers=32, num_kv_heads=8, head_dim=128, cache_kind=CacheKind.SPLIT
    )
    torch.set_num_threads(1)  # one core per rank, as the engines run here
    settings = RoleSettings(tensor_parallel_size=1, block_size=BLOCK, kv_layout=KVLayout.HND)
    plan = build_plan(model, settings, settings, TransferSettings())
    num_blocks = blocks_for_tokens(max(tokens_list), BLOCK) * 2
    tag = uuid.uuid4().hex[:6]
    p_cache = KVCache.allocate(model, BLOCK, KVLayout.HND, 1, 0, num_blocks)
    d_cache = KVCache.allocate(model, BLOCK, KVLayout.HND, 1, 0, num_blocks)
    for tensor in p_cache.tensors:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    p_transport, d_transport = Transport(f"p-{tag}"), Transport(f"d-{tag}")
    p_transport.register(p_cache.tensors)
    d_transport.register(d_cache.tensors)
    prefill = PrefillRank(p_cache, p_transport, plan, f"prefill-{tag}", "inc")
    decode = DecodeRank(d_cache, d_transport, settings, TransferSettings())
    decode.add_peer(f"prefill-{tag}", "inc", {0: (prefill.metadata(), p_transport.metadata())})

    def read(params: KVTransferParams, blocks: list[int], verify: Verify | None) -> ReadResult:
        result = decode.start(f"d-{uuid.uuid4().hex[:6]}", params, blocks, 30.0, verify)
        deadline = time.monotonic() + 60
        while result is None and time.monotonic() < deadline:
            done = decode.poll()
            prefill.poll()
            result = done[0] if done else None
        if result is None:
            sys.exit("no result within 60 s")
        return result

    for tokens in tokens_list:
        n = blocks_for_tokens(tokens, BLOCK)
        p_blocks, d_blocks = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))  # scattered: one descriptor each
        samples: dict[str, list[float]] = {"read": [], "prefill_digest": [], "decode_digest": []}
        for repeat in range(repeats + 1):
            request = f"r{tokens}-{repeat}"
            key = new_key()
            started = time.perf_counter()
            digests = RequestDigests(key, prefill.offer(request, p_blocks, tokens, key))
            prefill_seconds = time.perf_counter() - started
            params = KVTransferParams(
                remote_engine_id=f"prefill-{tag}",
                remote_incarnation="inc",
                remote_host="127.0.0.1",
                remote_port=1,
                remote_request_id=request,
                num_tokens=tokens,
                remote_tp_size=1,
                fingerprint=plan.fingerprint,
                remote_block_ids=wire_block_ids(p_blocks, tokens, 1, BLOCK).tolist(),
            )
            plain = read(params, d_blocks, None)
            verified = read(params, d_blocks, Verify(digests, d_blocks, tokens))
            if not (plain.ok and verified.ok):
                sys.exit(f"transfer failed: {plain.message or verified.message}")
            digested = decode.digester.take_seconds() if decode.digester is not None else []
            if not digested:
                sys.exit("the verified read recorded no digest time")
            if repeat:  # the first is a warm-up
                samples["read"].append(plain.seconds)
                samples["prefill_digest"].append(prefill_seconds)
                samples["decode_digest"].append(digested[-1])
        median = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        print(
            json.dumps(
                {
                    "tokens": tokens,
                    "MiB": round(tokens * model.kv_bytes_per_token / 2**20, 1),
                    "read_ms": round(median["read"], 2),
                    "prefill_digest_ms": round(median["prefill_digest"], 2),
                    "decode_digest_ms": round(median["decode_digest"], 2),
                    "decode_digest_vs_read": round(median["decode_digest"] / median["read"], 2),
                    "prefill_digest_vs_read": round(median["prefill_digest"] / median["read"], 2),
                }
            ),
            flush=True,
        )
    decode.close()
    d_transport.close()
    p_transport.close()


def run_revision(tree: Path | None, tokens: list[int], repeats: int) -> list[dict[str, Any]]:
    """One run of a revision's own script in its own process (``tree``: extracted sources; None: this checkout)."""
    script = (tree or ROOT) / "benchmarks" / "digest_cost.py"
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join((str(tree / "agent"), str(tree / "operator")))
    command = [sys.executable, str(script), "--tokens", *map(str, tokens), "--repeats", str(repeats)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def compare(revision: str, tokens: list[int], repeats: int, rounds: int) -> None:
    """This checkout and ``revision`` taking turns; per size, each one's medians over the rounds."""
    runs: dict[str, list[list[dict[str, Any]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as workdir:
        tree = Path(workdir, "before")
        tree.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision, "agent", "operator", "benchmarks"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for turn in range(rounds):
            runs["before"].append(run_revision(tree, tokens, repeats))
            runs["after"].append(run_revision(None, tokens, repeats))
            print(f"round {turn + 1}/{rounds} done", file=sys.stderr, flush=True)
    for index, size in enumerate(tokens):
        row: dict[str, Any] = {"tokens": size, "MiB": runs["after"][0][index]["MiB"]}
        for name, label in (("before", revision), ("after", "this checkout")):
            figures = {f: statistics.median(run[index][f] for run in runs[name]) for f in FIGURES}
            row[name] = {"revision": label, **{f: round(v, 2) for f, v in figures.items()}}
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also measure the digest of this git revision (say, the "
        "commit before a change), taking turns with this checkout's, and report both",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns each revision takes with --before (default 3)")
    args = parser.parse_args()
    if args.before:
        compare(args.before, args.tokens, args.repeats, args.rounds)
    else:
        measure(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
