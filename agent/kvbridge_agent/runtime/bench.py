"""``kvbridge-agent bench``: throughput as a fraction of this machine's ceilings, measured in one run.

- memcpy: single-threaded copy of a 256 MiB buffer (the physical limit here);
- raw NIXL: one 256 MiB READ between two processes with one descriptor (the transport ceiling);
- kvbridge: requests through real engine processes (``kvbridge-agent serve``, verification off),
  per cache kind and TP pair, with kvbridge's own per-request CPU time (block ids -> descriptor ids).

Medians over repeated trials. A first version: block ids are allocated contiguously by the
engine (scattered ids, descriptor-size sweeps and the plot are still to come).
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment

from .keys import generate_keys
from .processes import start_engine

SIZE = 256 << 20
CONFIGS = (  # name, cache kind, prefill TP, decode TP
    ("split-tp1to1", "Split", 1, 1),
    ("split-tp2to1", "Split", 2, 1),
    ("crosslayer-tp1to1", "CrossLayer", 1, 1),
    ("crosslayer-tp2to1", "CrossLayer", 2, 1),
)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def memcpy_gbps(trials: int = 5) -> float:
    source = np.ones(SIZE, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch the pages first
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return SIZE / statistics.median(times) / 1e9


def _holder(conn: Connection, name: str) -> None:
    import os

    import torch

    os.dup2(2, 1)  # the parent's stdout carries only its result
    from .transport import Transport

    tensor = torch.ones(SIZE, dtype=torch.uint8)
    transport = Transport(name)
    transport.register([tensor])
    conn.send((transport.metadata(), tensor.data_ptr()))
    while not conn.poll(0.0005):
        transport.notifications()  # keep progressing while the reader works
    transport.close()


def nixl_raw_gbps(trials: int = 5) -> float:
    import torch

    from .transport import Transport

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    tag = uuid.uuid4().hex[:8]
    holder = context.Process(target=_holder, args=(child, f"bench-src-{tag}"), daemon=True)
    holder.start()
    transport = Transport(f"bench-dst-{tag}")
    try:
        target = torch.zeros(SIZE, dtype=torch.uint8)
        transport.register([target])
        if not parent.poll(120):
            raise RuntimeError("the NIXL source process did not start")
        metadata, base = parent.recv()
        peer = transport.add_peer(metadata)
        remote = transport.prep(peer, np.array([[base, SIZE, 0]], dtype=np.int64), "DRAM")
        local = transport.prep("", np.array([[target.data_ptr(), SIZE, 0]], dtype=np.int64), "DRAM")
        ids = np.zeros(1, dtype=np.int64)
        times = []
        for _ in range(trials + 1):  # the first READ warms the connection
            start = time.perf_counter()
            handle = transport.read(local, ids, remote, ids, b"")
            while transport.state(handle) == "PROC":
                pass
            times.append(time.perf_counter() - start)
            transport.release(handle)
        return SIZE / statistics.median(times[1:]) / 1e9
    finally:
        parent.send("stop")
        holder.join(timeout=30)
        transport.close()


def measure_pair(
    name: str,
    model: ModelGeometry,
    prefill: RoleSettings,
    decode: RoleSettings,
    *,
    tokens: int,
    requests: int,
    keys_dir: str,
    num_blocks: int,
) -> tuple[list[dict[str, Any]], float]:
    """Decode results of ``requests`` requests through a fresh prefill/decode engine pair (verification off),
    after a first request that carries the handshake; and the handshake time in seconds."""
    common: dict[str, Any] = {
        "model": model, "prefill": prefill, "decode": decode, "keys_dir": keys_dir, "num_blocks": num_blocks,
        "http_port": 0, "side_channel_listen_port": 0, "verify": False,
    }  # fmt: skip
    prefill_engine = start_engine(EngineEnvironment(role=Role.PREFILL, engine_id=f"bench-{name}-p", **common))
    try:
        decode_engine = start_engine(EngineEnvironment(role=Role.DECODE, engine_id=f"bench-{name}-d", **common))
        try:
            rows = []
            for index in range(requests + 1):
                progress(f"  {name}: request {index + 1}/{requests + 1}")
                _, body = prefill_engine.post("/v1/prefill", {"requestId": f"r{index}", "numTokens": tokens})
                status, result = decode_engine.post(
                    "/v1/decode", {"requestId": f"d{index}", "kvTransferParams": body["kvTransferParams"]}
                )
                if status != 200:
                    raise RuntimeError(f"{name}: {result}")
                if index:
                    rows.append(result)
            return rows, decode_engine.handshake_seconds()
        finally:
            decode_engine.stop()
    finally:
        prefill_engine.stop()


def kvbridge_results(keys_dir: str, requests: int, raw: float, memcpy: float) -> tuple[list[dict[str, Any]], float]:
    results = []
    handshake_ms = 0.0
    for name, kind, tp_p, tp_d in CONFIGS:
        model = ModelGeometry(name="bench", num_layers=32, num_kv_heads=8, head_dim=128, cache_kind=kind)
        rows, handshake = measure_pair(
            name, model, RoleSettings(tensor_parallel_size=tp_p), RoleSettings(tensor_parallel_size=tp_d),
            tokens=64 * 16, requests=requests, keys_dir=keys_dir, num_blocks=80,
        )  # fmt: skip
        handshake_ms = max(handshake_ms, handshake * 1e3)
        gbps = rows[0]["bytes"] / statistics.median(r["transferSeconds"] for r in rows) / 1e9
        results.append({
            "name": name, "cacheKind": kind, "gbps": round(gbps, 3), "ratioToRaw": round(gbps / raw, 3),
            "ratioToMemcpy": round(gbps / memcpy, 3), "descriptorsPerRequest": rows[0]["descriptors"],
            "overheadUsPerRequest": round(statistics.median(r["idsMicroseconds"] for r in rows), 1),
            "nixlMakeUsPerRequest": round(statistics.median(r["makeMicroseconds"] for r in rows), 1),
        })  # fmt: skip
    return results, handshake_ms


def bench(requests: int = 5) -> dict[str, Any]:
    progress("measuring memcpy ...")
    memcpy = memcpy_gbps()
    progress("measuring raw NIXL (one 256 MiB descriptor, two processes) ...")
    raw = nixl_raw_gbps()
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as keys_dir:
        generate_keys(keys_dir)
        results, handshake_ms = kvbridge_results(keys_dir, requests, raw, memcpy)
    return {"memcpyGBps": round(memcpy, 3), "nixlRawGBps": round(raw, 3), "results": results,
            "handshakeMs": round(handshake_ms, 2)}  # fmt: skip
