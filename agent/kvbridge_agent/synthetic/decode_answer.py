"""What one decode request's ranks answered, as the synthetic engine's answer and metrics: the first failure as a
typed error with every block to recompute, else the bytes, descriptors and times the ranks measured."""

from __future__ import annotations

import time
from typing import Any

from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.synthetic.ranks import RANK_FAILED, EngineError
from kvbridge_agent.transfer.metrics import AgentMetrics


def answer(
    metrics: AgentMetrics,
    verify: bool,
    request_id: str,
    params: KVTransferParams,
    replies: list[dict[str, Any]],
    started: float,
) -> dict[str, Any]:
    """The engine's answer to a read every rank replied to (``verify``: the engine checks every byte it read);
    raises :class:`EngineError` with the blocks to recompute when a rank failed."""
    labels = metrics.labels
    failed = [r for r in replies if not r.get("ok")]
    if failed:
        first = failed[0]
        if any(r.get("code") == KV_DIGEST_MISMATCH for r in failed):
            metrics.digest_mismatches.labels(**labels, peer=params.remote_engine_id).inc()
        invalid = sorted({b for r in failed for b in r.get("invalidBlocks", [])})
        metrics.failed_transfers.labels(**labels, code=first.get("code", RANK_FAILED)).inc()
        metrics.requests.labels(**labels, outcome="failed").inc()
        raise EngineError(
            first.get("message", "read failed"),
            code=first.get("code", RANK_FAILED),
            status=502,
            invalid_blocks=invalid,
        )
    seconds = max(r["seconds"] for r in replies)
    moved = sum(int(r["bytes"]) for r in replies)
    descriptors = sum(int(r["descriptors"]) for r in replies)
    metrics.transfer_seconds.labels(**labels).observe(seconds)
    metrics.bytes.labels(**labels).inc(moved)
    metrics.descriptors.labels(**labels).observe(descriptors)
    metrics.requests.labels(**labels, outcome="verified" if verify else "done").inc()
    return {
        "ok": True,
        "requestId": request_id,
        "verified": all(r.get("verified") for r in replies),
        "bytes": moved,
        "descriptors": descriptors,
        #: how the ranks read: ``direct``, ``staged`` (docs/protocol.md §4d), or both where they differed
        "mode": ",".join(sorted({str(r.get("mode", "direct")) for r in replies})),
        "transferSeconds": seconds,
        "idsMicroseconds": max(r["idsMicroseconds"] for r in replies),
        "makeMicroseconds": max(r["makeMicroseconds"] for r in replies),
        "postMicroseconds": max(r["postMicroseconds"] for r in replies),
        "ownMicroseconds": max(r["ownMicroseconds"] for r in replies),
        "verifySeconds": max(r.get("verifySeconds", 0.0) for r in replies),
        "totalSeconds": time.perf_counter() - started,
    }
