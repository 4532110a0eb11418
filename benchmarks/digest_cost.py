"""What verifying a transfer costs (core.digest, kvbridge-digest/1): the digest on prefill (after compute, before
any reader) and on decode (after the READs and conversions), against the transfer it verifies, measured in one run.

Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per token), one prefill and one
decode rank in this process with real NIXL agents on DRAM, 16-token blocks, requests of 128 to 2,048 tokens;
each row is the median of ``--repeats`` requests. Run: ``.venv/bin/python benchmarks/digest_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

import torch

from kvbridge_agent.core import CacheKind, KVLayout, ModelGeometry, RoleSettings, TransferSettings, build_plan
from kvbridge_agent.core.blocks import blocks_for_tokens, wire_block_ids
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.transfer.decode_rank import DecodeRank, ReadResult, Verify
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.transport import Transport

MODEL = ModelGeometry(name="llama3-8b-geometry", num_layers=32, num_kv_heads=8, head_dim=128,
                      cache_kind=CacheKind.SPLIT)  # fmt: skip
BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as the engines run here
    settings = RoleSettings(tensor_parallel_size=1, block_size=BLOCK, kv_layout=KVLayout.HND)
    plan = build_plan(MODEL, settings, settings, TransferSettings())
    num_blocks = blocks_for_tokens(max(args.tokens), BLOCK) * 2
    tag = uuid.uuid4().hex[:6]
    p_cache = KVCache.allocate(MODEL, BLOCK, KVLayout.HND, 1, 0, num_blocks)
    d_cache = KVCache.allocate(MODEL, BLOCK, KVLayout.HND, 1, 0, num_blocks)
    for tensor in p_cache.tensors:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    p_transport, d_transport = Transport(f"p-{tag}"), Transport(f"d-{tag}")
    p_transport.register(p_cache.tensors)
    d_transport.register(d_cache.tensors)
    prefill = PrefillRank(p_cache, p_transport, plan, f"prefill-{tag}", "inc")
    decode = DecodeRank(d_cache, d_transport, settings, TransferSettings())
    decode.add_peer(f"prefill-{tag}", "inc", {0: (prefill.metadata(), p_transport.metadata())})
    rows = []
    for tokens in args.tokens:
        n = blocks_for_tokens(tokens, BLOCK)
        p_blocks, d_blocks = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))  # scattered: one descriptor each
        samples: dict[str, list[float]] = {"read": [], "prefill_digest": [], "decode_digest": []}
        for repeat in range(args.repeats + 1):
            request = f"r{tokens}-{repeat}"
            started = time.perf_counter()
            digests = prefill.offer(request, p_blocks, tokens)
            prefill_seconds = time.perf_counter() - started
            params = KVTransferParams(
                remote_engine_id=f"prefill-{tag}", remote_incarnation="inc", remote_host="127.0.0.1", remote_port=1,
                remote_request_id=request, num_tokens=tokens, remote_tp_size=1, fingerprint=plan.fingerprint,
                remote_block_ids=wire_block_ids(p_blocks, tokens, 1, BLOCK).tolist(),
            )  # fmt: skip
            plain = _read(decode, prefill, params, d_blocks, None)
            verified = _read(decode, prefill, params, d_blocks, Verify(digests, d_blocks, tokens))
            if not (plain.ok and verified.ok):
                sys.exit(f"transfer failed: {plain.message or verified.message}")
            if repeat:  # the first is a warm-up
                samples["read"].append(plain.seconds)
                samples["prefill_digest"].append(prefill_seconds)
                samples["decode_digest"].append(decode.last_digest_seconds)
        median = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        rows.append({"tokens": tokens, "MiB": round(tokens * MODEL.kv_bytes_per_token / 2**20, 1),
                     "read_ms": round(median["read"], 2), "prefill_digest_ms": round(median["prefill_digest"], 2),
                     "decode_digest_ms": round(median["decode_digest"], 2),
                     "decode_digest_vs_read": round(median["decode_digest"] / median["read"], 2),
                     "prefill_digest_vs_read": round(median["prefill_digest"] / median["read"], 2)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    decode.close()
    d_transport.close()
    p_transport.close()


def _read(decode: DecodeRank, prefill: PrefillRank, params: KVTransferParams, blocks: list[int],
          verify: Verify | None) -> ReadResult:  # fmt: skip
    result = decode.start(f"d-{uuid.uuid4().hex[:6]}", params, blocks, 30.0, verify)
    deadline = time.monotonic() + 60
    while result is None and time.monotonic() < deadline:
        done = decode.poll()
        prefill.poll()
        result = done[0] if done else None
    if result is None:
        sys.exit("no result within 60 s")
    return result


if __name__ == "__main__":
    main()
