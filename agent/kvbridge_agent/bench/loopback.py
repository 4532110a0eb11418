"""``kvbridge-agent loopback``: one prefill and one decode engine on 127.0.0.1, real NIXL, verified bytes.

Both engines run as ``kvbridge-agent serve`` processes (each TP rank its own
process), with the real side channel (CURVE keys generated for the run) and
real NIXL READs over DRAM.  This process plays the router: it asks prefill
to compute each request, hands ``kv_transfer_params`` to decode, and
collects decode's verification of every byte.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.core import Role, build_plan
from kvbridge_agent.core.blocks import blocks_for_tokens
from kvbridge_agent.core.contract import EngineEnvironment, PairSpec
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.transfer.keys import generate_keys


@dataclass(frozen=True)
class RequestShape:
    num_tokens: int
    prefix_hit_blocks: int


def request_shapes(pair: PairSpec, count: int, seed: int, num_blocks: int) -> list[RequestShape]:
    """Varied prompt lengths: partial last blocks, a partial prefix hit, a full hit, one-token prompts."""
    rng = random.Random(seed)
    bs_p, bs_d = pair.prefill.block_size, pair.decode.block_size
    largest = max(bs_p, bs_d)
    max_tokens = max(1, (num_blocks // 2) * min(bs_p, bs_d) - largest)
    shapes: list[RequestShape] = []
    for index in range(count):
        if index == 0:
            tokens = min(max_tokens, 3 * largest + 1)  # a partial last block
        elif index == 1:
            tokens = 1
        else:
            tokens = rng.randint(1, max_tokens)
        total = blocks_for_tokens(tokens, bs_d)
        hit = 0
        if index % 4 == 2 and total >= 2:
            hit = rng.randint(1, total - 1)  # a partial prefix hit
        elif index % 8 == 5:
            hit = total  # a full hit: notify, read nothing
        shapes.append(RequestShape(tokens, hit))
    return shapes


@dataclass
class LoopbackReport:
    ok: bool
    requests: int
    verified: int
    failures: list[dict[str, str]] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    prefill_ranks: int = 0
    decode_ranks: int = 0
    descriptors_per_request: int = 0
    handshake_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "requests": self.requests,
            "verifiedRequests": self.verified,
            "failures": self.failures,
            "bytesTransferred": self.bytes,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.bytes / self.seconds / 1e9, 3) if self.seconds > 0 else 0.0,
            "prefillRanks": self.prefill_ranks,
            "decodeRanks": self.decode_ranks,
            "descriptorsPerRequest": self.descriptors_per_request,
        }


def environments(name: str, pair: PairSpec, num_blocks: int, keys_dir: str) -> tuple[EngineEnvironment, ...]:
    common: dict[str, Any] = {
        "deployment": name,
        "model": pair.model,
        "prefill": pair.prefill,
        "decode": pair.decode,
        "transfer": pair.transfer,
        "side_channel_host": "127.0.0.1",
        "side_channel_listen_port": 0,
        "keys_dir": keys_dir,
        "num_blocks": num_blocks,
        "http_port": 0,
    }
    return tuple(
        EngineEnvironment(role=role, engine_id=f"{name}-{role.value}-0", **common)
        for role in (Role.PREFILL, Role.DECODE)
    )


def run_requests(
    prefill: EngineProcess, decode: EngineProcess, shapes: list[RequestShape], tag: str, progress: bool = False
) -> LoopbackReport:
    report = LoopbackReport(False, len(shapes), 0)
    descriptors = 0
    for index, shape in enumerate(shapes):
        request_id = f"{tag}-{index}"
        status, body = prefill.post("/v1/prefill", {"requestId": request_id, "numTokens": shape.num_tokens})
        if status != 200:
            error = body.get("error", {})
            report.failures.append(
                {
                    "request": request_id,
                    "code": error.get("code", str(status)),
                    "message": "prefill: " + error.get("message", ""),
                }
            )
            continue
        status, body = decode.post(
            "/v1/decode",
            {
                "requestId": f"decode-{request_id}",
                "kvTransferParams": body["kvTransferParams"],
                "prefixHitBlocks": shape.prefix_hit_blocks,
            },
        )
        if status != 200:
            error = body.get("error", {})
            report.failures.append(
                {"request": request_id, "code": error.get("code", str(status)), "message": error.get("message", "")}
            )
            continue
        if body.get("verified") is not True:
            report.failures.append(
                {"request": request_id, "code": "NOT_VERIFIED", "message": "decode did not verify the bytes"}
            )
            continue
        report.verified += 1
        report.bytes += int(body["bytes"])
        report.seconds += float(body["transferSeconds"])
        descriptors += int(body["descriptors"])
        if progress:
            print(
                f"  request {index + 1}/{len(shapes)}: {shape.num_tokens} tokens, prefix hit "
                f"{shape.prefix_hit_blocks} block(s): verified",
                file=sys.stderr,
                flush=True,
            )
    report.descriptors_per_request = descriptors // max(1, report.verified)
    report.ok = report.verified == report.requests
    return report


def loopback(
    name: str,
    pair: PairSpec,
    *,
    requests: int = 16,
    seed: int = 0,
    num_blocks: int = 64,
    progress: bool = False,
    log_level: str = "WARNING",
) -> LoopbackReport:
    """Run the whole loopback and stop every process it started, whatever happens."""
    build_plan(pair.model, pair.prefill, pair.decode, pair.transfer)  # incompatible: raise before starting anything
    with tempfile.TemporaryDirectory(prefix="kvbridge-keys-") as keys_dir:
        generate_keys(keys_dir)
        prefill_env, decode_env = environments(name, pair, num_blocks, keys_dir)
        started: list[EngineProcess] = []
        try:
            if progress:
                print(
                    f"starting prefill (TP {pair.prefill.tensor_parallel_size}) and decode "
                    f"(TP {pair.decode.tensor_parallel_size}) engines ...",
                    file=sys.stderr,
                    flush=True,
                )
            started.append(start_engine(prefill_env, log_level=log_level))
            started.append(start_engine(decode_env, log_level=log_level))
            shapes = request_shapes(pair, requests, seed, num_blocks)
            begin = time.perf_counter()
            report = run_requests(started[0], started[1], shapes, f"loopback-{seed}", progress)
            if progress:
                print(
                    f"{report.verified}/{report.requests} requests verified in {time.perf_counter() - begin:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
            report.prefill_ranks = pair.prefill.tensor_parallel_size
            report.decode_ranks = pair.decode.tensor_parallel_size
            return report
        finally:
            for engine in reversed(started):
                engine.stop()
