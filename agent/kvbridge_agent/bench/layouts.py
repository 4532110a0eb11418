"""``kvbridge-agent bench --layouts``: vLLM's physical KV layouts, moved the connector's way, against this machine's
ceilings measured in the same run.

Every ``KVCacheLayout`` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) on both sides, and a few heterogeneous pairs
(prefill TP 2 -> decode TP 1 on per-layer LBHNC, a 16 -> 32-token block conversion, the cross-order pairs
LBHNC -> BLHNC and LBHNC -> LBNHC), for a Llama-3-8B geometry (32 layers, 8 KV heads of 128, bf16) and a 70B-class
one (80 layers, 8 KV heads of 128, bf16). Each side's cache is what vLLM's own allocator builds for the layout
(``allocate_kv_cache(..., device=cpu, layout)``: strided per-layer views of one allocation), attached the way the
connector's worker attaches it (``KVCache.attach_views``); each prefill rank is a
:class:`~kvbridge_agent.transfer.prefill_rank.PrefillRank` in its own process (as in ``bench``'s raw NIXL
ceiling: two processes, UCX over DRAM), the decode rank a :class:`~kvbridge_agent.transfer.decode_rank.DecodeRank`
in this one, joined by their handshake metadata (the side channel, verification and the scheduler are left out:
per request this is the connector worker's path from block ids to completed READs).

With ``--zoo`` (:mod:`.layout_zoo`) the cases run on the geometries of the model zoo's families kvbridge accepts
instead, hybrid KV cache groups and MLA included.

Per layout pair and geometry it reports descriptors and bytes per request, GB/s, GB/s as a fraction of raw NIXL
(one descriptor, and at the request's descriptor size) and of memcpy, both measured in the same run by
:mod:`.measure`, and kvbridge's own CPU work per request (``ReadResult.own_microseconds``, ``ids_microseconds``)
beside NIXL's (make and post; on host memory the copy runs inside the post call). Medians over the requests.
"""

from __future__ import annotations

import gc
import os
import platform
import resource
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge_agent.core import ModelGeometry, RoleSettings
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.handshake import KVTransferParams, RankMetadata

from .layout_cases import LLAMA_8B, LLAMA_70B, Case, block_ids, cache_blocks, cache_bytes, cases, staging_bytes
from .layout_prefill import TRANSFER, Allocate, Prefill, ProcessPrefill, attach
from .layout_report import print_report, targets, transport_note
from .layout_zoo import MOST_TOKENS, run_family, zoo_cache_bytes, zoo_families
from .measure import memcpy_gbps, nixl_ceilings, progress, raw_at

if TYPE_CHECKING:  # NIXL's bindings: imported where a case runs
    from kvbridge_agent.core.stage_requests import StageReply, StageRequest
    from kvbridge_agent.transfer.decode_rank import DecodeRank
    from kvbridge_agent.transfer.reads import ReadResult

__all__ = ["bench_layouts", "print_report", "run_case", "targets", "transport_note"]
#: how decode reads each request: between the caches, and through the staging buffers (docs/protocol.md §4d)
MODES = ("direct", "staged")

#: the descriptor sizes of the raw NIXL sweep: ``bench``'s, and below it down to one token of one head (512 bytes:
#: what the cross-order pair LBHNC -> LBNHC moves per descriptor)
SWEEP = (512, 2 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
TIMEOUT = 120.0


# -- one case ------------------------------------------------------------------------------------------------------
class RawReference:
    """Raw NIXL beside a case: ``bytes`` (a request's) read from the prefill ranks' allocations into decode's, one
    descriptor per prefill rank (``bytes / ranks`` each), by the decode rank's own agent."""

    def __init__(
        self, transport: Any, local: Any, agents: dict[int, str], allocations: list[tuple[int, int]], size: int
    ) -> None:
        self.transport = transport
        share = size // len(allocations)
        self.bytes = share * len(allocations)
        base = local.data_ptr()
        memory, device_id = ("VRAM", local.device.index or 0) if local.is_cuda else ("DRAM", 0)
        if self.bytes > local.numel() * local.element_size() or any(share > have for _, have in allocations):
            raise ValueError(f"a {size}-byte reference does not fit the caches")
        self.lists = [
            (
                transport.prep("", np.array([[base + rank * share, share, device_id]], dtype=np.int64), memory),
                transport.prep(agents[rank], np.array([[address, share, device_id]], dtype=np.int64), memory),
            )
            for rank, (address, _) in enumerate(allocations)
        ]

    def read(self, progress: Any) -> float:
        """Seconds to read the reference (posting to every READ done)."""
        ids = np.zeros(1, dtype=np.int32)
        started = time.perf_counter()
        handles = [self.transport.read(local, ids, remote, ids, b"") for local, remote in self.lists]
        while any(self.transport.state(h) == "PROC" for h in handles):
            progress()
        seconds = time.perf_counter() - started
        states = [self.transport.state(h) for h in handles]
        for handle in handles:
            self.transport.release(handle)
        if states != ["DONE"] * len(handles):
            raise RuntimeError(f"a raw NIXL READ ended {states}")
        return seconds

    def close(self) -> None:
        for local, remote in self.lists:
            self.transport.release_dlist(local)
            self.transport.release_dlist(remote)


class CaseReads:
    """The decode side of one case: its rank reading ``tokens``-token requests from the prefill ranks (prefill rank
    ``p`` on ``prefills[p]``), and the raw NIXL reference measured beside them."""

    def __init__(
        self,
        reader: DecodeRank,
        raw: RawReference,
        run: tuple[ModelGeometry, Case, Sequence[Prefill], int],
        blocks: tuple[int, int],
        incarnation: str,
        seed: int,
    ) -> None:
        self.reader, self.raw, self.incarnation = reader, raw, incarnation
        self.model, self.case, self.prefills, self.tokens = run
        self.prefill_blocks, self.decode_blocks = blocks
        self.rng = np.random.default_rng(seed)

    def progress_prefills(self) -> None:
        for p in range(self.case.prefill.tp):
            self.prefills[p].progress()

    def one(self, request_id: str, allocation: str) -> ReadResult:
        """One request's READs, its blocks placed as ``allocation`` says, until it ends (its result)."""
        case, tokens = self.case, self.tokens
        remote = block_ids(ceil_div(tokens, case.prefill.block), self.prefill_blocks, allocation, self.rng)
        local = block_ids(ceil_div(tokens, case.decode.block), self.decode_blocks, allocation, self.rng)
        wires = [self.prefills[p].offer(request_id, remote, tokens) for p in range(case.prefill.tp)]
        params = KVTransferParams(
            remote_engine_id="layouts-prefill",
            remote_incarnation=self.incarnation,
            remote_host="127.0.0.1",
            remote_port=1,
            remote_request_id=request_id,
            remote_block_ids=wires[0],
            num_tokens=tokens,
            remote_tp_size=case.prefill.tp,
            fingerprint="layouts",
        )
        result = self.reader.start(request_id, params, local, TIMEOUT)
        while result is None:
            self.progress_prefills()
            done = self.reader.poll()
            result = done[0] if done else None
        if not result.ok:
            raise RuntimeError(f"{case.name}, {self.model.name}: {result.code}: {result.message}")
        return result

    def row(self, allocation: str, requests: int, mode: str = "direct") -> dict[str, Any]:
        """``requests`` requests of one block allocation read ``mode`` (``direct``, or ``staged`` where the rank
        stages), each after a raw reference read: the row."""
        staging = self.reader.staging
        if staging is not None:
            staging.mode = mode
        results, references = [], []
        for index in range(requests):  # taking turns, so that both meet the same load of the machine
            references.append(self.raw.read(self.progress_prefills))
            results.append(self.one(f"{self.case.name}-{allocation}-{mode}-{index}", allocation))
        row = _row(self.model, self.case, self.tokens, allocation, results)
        row["rawHereGBps"] = round(self.raw.bytes / _median(references) / 1e9, 3)
        row["ratioToRawHere"] = round(row["gbps"] / row["rawHereGBps"], 3)
        row["mode"] = mode
        if mode == "staged" and staging is not None:
            row.update(_staged_fields(results, staging))
        return row

    def wait_notified(self) -> None:
        """Until every prefill rank was notified of every READ (at most ``TIMEOUT`` seconds)."""
        deadline = time.monotonic() + TIMEOUT
        while any(self.prefills[p].pending() for p in range(self.case.prefill.tp)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.case.name}: a prefill rank was never notified")
            self.reader.poll()
            time.sleep(0.001)


def run_case(
    allocate: Allocate,
    model: ModelGeometry,
    case: Case,
    prefills: Sequence[Prefill],
    tokens: int,
    requests: int,
    block_allocations: Sequence[str] = (),
    seed: int = 0,
    modes: Sequence[str] = ("direct",),
) -> list[dict[str, Any]]:
    """``requests`` requests of ``tokens`` tokens per block allocation (the case's unless ``block_allocations``;
    after one warm-up) and read mode, prefill rank ``p`` on ``prefills[p]``: one row per allocation and mode. Before
    each request, raw NIXL moves the same bytes between the same agents and allocations with one descriptor per
    prefill rank (the reference measured beside it: ``rawHereGBps``). With ``staged`` among ``modes`` both sides get
    staging buffers (docs/protocol.md §4d)."""
    from kvbridge_agent.transfer.decode_rank import DecodeRank
    from kvbridge_agent.transfer.transport import Transport

    tag = uuid.uuid4().hex[:8]
    prefill_blocks = cache_blocks(tokens, case.prefill.block)
    decode_blocks = cache_blocks(tokens, case.decode.block)
    ranks: dict[int, tuple[RankMetadata, bytes]] = {}
    allocations: list[tuple[int, int]] = []  # each prefill rank's allocation: address, bytes
    decode: DecodeRank | None = None
    transport: Transport | None = None
    raw: RawReference | None = None
    try:
        for rank in range(case.prefill.tp):
            meta_json, agent, address, size = prefills[rank].setup(
                allocate, model, case, rank, prefill_blocks, tag, "staged" in modes
            )
            ranks[rank] = (RankMetadata.model_validate_json(meta_json), agent)
            allocations.append((address, size))
        cache = attach(allocate, model, case.decode, 0, decode_blocks)
        transport = Transport(f"layouts-decode-{tag}")
        transport.register(cache.tensors)
        settings = RoleSettings(tensor_parallel_size=case.decode.tp, block_size=case.decode.block)
        staging = staging_bytes(model, tokens, case.decode.tp) if "staged" in modes else 0
        decode = DecodeRank(cache, transport, settings, TRANSFER, staging_bytes=staging, stager=_stager(prefills))
        incarnation = f"inc-{tag}"
        peer = decode.add_peer("layouts-prefill", incarnation, ranks)
        raw = RawReference(transport, cache.tensors[0], peer.agents, allocations, model.kv_bytes_per_token * tokens)
        reads = CaseReads(
            decode, raw, (model, case, prefills, tokens), (prefill_blocks, decode_blocks), incarnation, seed
        )
        rows: list[dict[str, Any]] = []
        for mode in modes:
            if decode.staging is not None:
                decode.staging.mode = mode
            reads.one(f"{case.name}-warm-{mode}", "contiguous")  # warms the connection; prefill meets the plan
            raw.read(reads.progress_prefills)
            rows.extend(reads.row(allocation, requests, mode) for allocation in block_allocations or case.allocations)
        if decode.staging is not None:
            rows[0]["costModel"] = decode.staging.cost.to_dict()
        reads.wait_notified()  # every READ was notified
        return rows
    finally:
        if raw is not None:
            raw.close()
        if decode is not None:
            decode.close()
        if transport is not None:
            transport.close()
        for rank in ranks:
            prefills[rank].teardown()
        gc.collect()


def _stager(prefills: Sequence[Prefill]) -> Any:
    """Stage requests to the prefill ranks as the side channel would hand them on (``Prefill.stage``)."""
    from kvbridge_agent.core import KVBridgeError
    from kvbridge_agent.core.stage_requests import StageReply

    def stage(params: Any, request: StageRequest) -> StageReply:
        try:
            reply = prefills[request.rank].stage(params.remote_request_id, request.model_dump_json())
        except RuntimeError as exc:  # a prefill process's refusal
            raise KVBridgeError(str(exc), code="STAGE_REFUSED") from exc
        return StageReply.model_validate_json(reply)

    return stage


def _staged_fields(results: Sequence[ReadResult], staging: Any) -> dict[str, Any]:
    choice = staging.last_choice
    return {
        "stagedShare": round(sum(r.mode == "staged" for r in results) / len(results), 3),
        "into": ",".join(sorted({r.into for r in results if r.into})),
        "prestagedShare": round(sum(r.prestaged for r in results) / len(results), 3),
        "stageUsPerRequest": round(_median([r.stage_microseconds for r in results]), 1),
        "packUsPerRequest": round(_median([r.pack_microseconds for r in results]), 1),
        "scatterUsPerRequest": round(_median([r.scatter_microseconds for r in results]), 1),
        "costModelPick": "staged" if choice is not None and choice.staged else "direct",
        "costModelDirectMs": round(choice.direct_seconds * 1e3, 3) if choice is not None else None,
        "costModelStagedMs": round(choice.staged_seconds * 1e3, 3) if choice is not None else None,
    }


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def label(model: ModelGeometry) -> str:
    """A geometry's short name in row names (``8b``, ``70b``)."""
    return model.name.removeprefix("llama3-").removesuffix("-geometry")


def _row(model: ModelGeometry, case: Case, tokens: int, allocation: str, results: Sequence[Any]) -> dict[str, Any]:
    moved, descriptors = int(results[0].bytes), int(results[0].descriptors)
    return {
        "name": f"{case.name}-{label(model)}-{allocation}",
        "case": case.name,
        "kind": case.kind,
        "geometry": model.name,
        "prefill": f"{case.prefill.layout} {case.prefill.block}-token TP {case.prefill.tp}",
        "decode": f"{case.decode.layout} {case.decode.block}-token TP {case.decode.tp}",
        "blockIds": allocation,
        "tokens": tokens,
        "bytesPerRequest": moved,
        "descriptorsPerRequest": descriptors,  # what NIXL posted (runs adjacent in both caches merged)
        "descriptorIdsPerRequest": int(results[0].indices),  # the ids kvbridge handed it
        "bytesPerDescriptor": moved // max(1, descriptors),
        "gbps": round(moved / _median([r.seconds for r in results]) / 1e9, 3),
        "ownUsPerRequest": round(_median([r.own_microseconds for r in results]), 1),
        "idsUsPerRequest": round(_median([r.ids_microseconds for r in results]), 1),
        "nixlMakeUsPerRequest": round(_median([r.make_microseconds for r in results]), 1),
        "nixlPostUsPerRequest": round(_median([r.post_microseconds for r in results]), 1),
    }


def add_ratios(rows: list[dict[str, Any]], memcpy: float, raw: float, sweep: list[dict[str, float]]) -> None:
    for row in rows:
        row["ratioToRaw"] = round(row["gbps"] / raw, 3)
        row["ratioToRawAtDescriptorSize"] = round(row["gbps"] / raw_at(sweep, row["bytesPerDescriptor"]), 3)
        row["ratioToMemcpy"] = round(row["gbps"] / memcpy, 3)


@contextmanager
def _prefill_processes(count: int) -> Iterator[list[ProcessPrefill]]:
    started = [ProcessPrefill() for _ in range(count)]
    try:
        for process in started:
            process.wait_ready()
        yield started
    finally:
        for process in started:
            process.stop()


def bench_layouts(
    allocate: Allocate,
    requests: int = 3,
    quick: bool = False,
    tokens: int | None = None,
    names: Sequence[str] = (),
    device: str = "cpu",
    allocator: str = "vLLM's allocate_kv_cache",
    zoo: bool = False,
) -> dict[str, Any]:
    """The whole run: ceilings, then every case (``names``: those) on both geometries (``quick``: Llama-3-8B,
    three cases, 512 tokens), each side's cache from ``allocate`` (named ``allocator`` in the result) on
    ``device``: the ceilings are measured there too (memcpy within its memory, raw NIXL between two of its
    buffers). ``zoo``: the zoo families' cases instead (``names``: those families; ``tokens``: the most prompt
    tokens a request has)."""
    began = time.monotonic()
    families = zoo_families(names) if zoo else []
    tokens = tokens or (MOST_TOKENS if zoo else 512 if quick else 2048)
    models = (LLAMA_8B,) if quick else (LLAMA_8B, LLAMA_70B)
    chosen = [c for f in families for c in f.cases()] if zoo else cases(quick, names)
    peak_cache = (
        zoo_cache_bytes(families, tokens) if zoo else max(cache_bytes(m, c, tokens) for m in models for c in chosen)
    )
    progress(f"layouts: starting 2 prefill processes (largest case: {peak_cache / 2**30:.2f} GiB of KV caches) ...")
    rows: list[dict[str, Any]] = []
    with _prefill_processes(max(c.prefill.tp for c in chosen)) as prefills:
        progress("measuring memcpy ...")
        memcpy = memcpy_gbps(device=device)
        progress(f"measuring raw NIXL (256 MiB, two processes, on {device}) ...")
        # the zoo's descriptors are 16 KiB or more (one token of one head at TP 2 -> 1 and more)
        raw, sweep = nixl_ceilings(sizes=SWEEP[3:] if zoo else SWEEP, device=device)
        note = transport_note(device, memcpy, raw)
        if note:
            progress(note)
        for family in families:
            progress(f"  {family.name}: {family.prompt_tokens(tokens)}-token prompts, {requests} requests per case")
            rows.extend(run_family(allocate, family, prefills, requests, tokens))
        for model in models if not zoo else ():
            for case in chosen:
                progress(f"  {case.name}, {model.name}: {requests} requests of {tokens} tokens per allocation")
                done = run_case(allocate, model, case, prefills, tokens, requests, modes=MODES)
                for row in done:  # as it comes: a run cut short keeps what it measured
                    progress(
                        f"    {row['name']} {row['mode']}: {row['gbps']} GB/s, {row['ratioToRawHere']} x raw NIXL "
                        f"beside it, {row['descriptorsPerRequest']} descriptors"
                    )
                rows.extend(done)
    add_ratios(rows, memcpy, raw, sweep)
    models_measured = [row.pop("costModel") for row in rows if "costModel" in row]
    return {
        "device": device,
        "allocator": allocator,
        "memcpyGBps": round(memcpy, 3),
        "nixlRawGBps": round(raw, 3),
        "costModel": {k: round(_median([m[k] for m in models_measured]), 3) for k in models_measured[0]}
        if models_measured
        else {},
        "costModels": models_measured,
        "descriptorSweep": sweep,
        "tokensPerRequest": tokens,
        "zoo": zoo,
        "largestCaseCacheBytes": peak_cache,
        "results": rows,
        "targets": targets(rows),
        "transportNote": note,
        "peakRssMiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "seconds": round(time.monotonic() - began, 1),
    }
