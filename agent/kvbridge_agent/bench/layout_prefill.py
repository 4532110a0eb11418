"""The layouts bench's prefill side: one side's cache as vLLM builds it, and a prefill rank of a case, in this process
(:class:`LocalPrefill`) or in its own (:class:`ProcessPrefill`, as the raw NIXL ceiling runs: two processes, UCX
over DRAM)."""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvbridge_agent.core import ModelGeometry, RoleSettings, TransferSettings, build_plan, wire_block_ids

from .layout_cases import Case, Side, staging_bytes

# -- one side's cache, as vLLM builds it --------------------------------------------------------------------------
#: ``(model, layout, block size, KV heads, blocks) -> per-layer views``: vLLM's allocator
#: (``kvbridge_agent.vllm_connector.host_cache.allocate_host_views``, which the command line hands in: only the
#: vLLM connector imports vllm), or :func:`own_views` where vLLM is not installed. A module-level function (or a
#: ``functools.partial`` of one, binding the device), so that it reaches the prefill processes by name.
Allocate = Callable[[ModelGeometry, str, int, int, int], dict[str, Any]]


def own_views(
    device: str, model: ModelGeometry, layout: str, block_size: int, heads: int, num_blocks: int
) -> dict[str, Any]:
    """kvbridge's ``layout_views``: the views vLLM's allocator builds (tests check them equal), for a machine without
    vLLM — a GPU machine lent for a benchmark, say."""
    import torch

    from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder
    from kvbridge_agent.transfer.allocations import layout_views

    content = model.token_bytes_per_head
    physical = PhysicalLayout.dense(PhysicalOrder(layout), model.num_layers, num_blocks, heads, block_size, content)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
    return layout_views(physical, names, torch.bfloat16, device)


def attach(allocate: Allocate, model: ModelGeometry, side: Side, rank: int, num_blocks: int) -> Any:
    from kvbridge_agent.core.layout import PhysicalOrder
    from kvbridge_agent.transfer.kv_cache import KVCache

    views = allocate(model, side.layout, side.block, side.heads(model), num_blocks)
    cache = KVCache.attach_views(model, side.block, side.tp, rank, views, PhysicalOrder(side.layout))
    cache.tensors[0].fill_(1)  # every page of the allocation touched before anything is timed
    return cache


class PrefillHost:
    """One prefill rank of a case: its cache, NIXL agent and :class:`PrefillRank` (what the connector's worker
    builds in ``register``)."""

    def __init__(
        self,
        allocate: Allocate,
        model: ModelGeometry,
        case: Case,
        rank: int,
        num_blocks: int,
        tag: str,
        staging: bool = False,
    ) -> None:
        from kvbridge_agent.transfer.prefill_rank import PrefillRank
        from kvbridge_agent.transfer.transport import Transport

        prefill, decode = case.prefill, case.decode
        self.cache = attach(allocate, model, prefill, rank, num_blocks)
        self.transport = Transport(f"layouts-prefill-{tag}-{rank}")
        self.transport.register(self.cache.tensors)
        plan = build_plan(
            model,
            RoleSettings(tensor_parallel_size=prefill.tp, block_size=prefill.block),
            RoleSettings(tensor_parallel_size=decode.tp, block_size=decode.block),
            TRANSFER,
        )
        buffer = staging_bytes(model, num_blocks * prefill.block, prefill.tp) if staging else 0
        self.rank = PrefillRank(self.cache, self.transport, plan, "layouts-prefill", f"inc-{tag}", staging_bytes=buffer)

    def handshake(self) -> Handshake:
        allocation = self.cache.tensors[0]
        metadata = self.rank.metadata().model_dump_json(exclude_none=True)
        return (
            metadata,
            self.transport.metadata(),
            allocation.data_ptr(),
            allocation.numel() * allocation.element_size(),
        )

    def offer(self, request_id: str, blocks: list[int], num_tokens: int) -> list[int]:
        """Offer a request's blocks (as the worker does); the wire block ids its parameters carry."""
        self.rank.offer(request_id, blocks)
        plan = self.rank.plan
        return [int(b) for b in wire_block_ids(blocks, num_tokens, plan.split_ratio, plan.wire.block_size)]

    def stage(self, request_id: str, request: str) -> str:
        """A stage request (JSON) as the side channel hands it to the rank; its reply (JSON)."""
        from kvbridge_agent.core.stage_requests import StageRequest

        return self.rank.stage(request_id, StageRequest.model_validate_json(request)).model_dump_json()

    def poll(self) -> None:
        self.rank.poll()

    def pending(self) -> int:
        self.rank.poll()
        return len(self.rank.pending)

    def close(self) -> None:
        self.transport.close()


#: a prefill rank's rank metadata (JSON), NIXL agent metadata, and its allocation's address and bytes
Handshake = tuple[str, bytes, int, int]

#: verification off: the figures are the transfer's (docs/benchmarks.md prices the digest separately)
TRANSFER = TransferSettings(verification="Off")


class Prefill(Protocol):
    def setup(
        self,
        allocate: Allocate,
        model: ModelGeometry,
        case: Case,
        rank: int,
        num_blocks: int,
        tag: str,
        staging: bool = False,
    ) -> Handshake: ...
    def offer(self, request_id: str, blocks: list[int], num_tokens: int) -> list[int]: ...
    def stage(self, request_id: str, request: str) -> str: ...
    def pending(self) -> int: ...
    def progress(self) -> None: ...
    def teardown(self) -> None: ...
    def stop(self) -> None: ...


class LocalPrefill:
    """A prefill rank in this process (the fast test's: one import of vLLM)."""

    def __init__(self) -> None:
        self.host: PrefillHost | None = None

    def setup(
        self,
        allocate: Allocate,
        model: ModelGeometry,
        case: Case,
        rank: int,
        num_blocks: int,
        tag: str,
        staging: bool = False,
    ) -> Handshake:
        """The rank's handshake; ``staging``: with a staging buffer (docs/protocol.md §4d)."""
        self.host = PrefillHost(allocate, model, case, rank, num_blocks, tag, staging)
        return self.host.handshake()

    def _host(self) -> PrefillHost:
        if self.host is None:
            raise RuntimeError("the prefill rank is not set up")
        return self.host

    def offer(self, request_id: str, blocks: list[int], num_tokens: int) -> list[int]:
        return self._host().offer(request_id, blocks, num_tokens)

    def stage(self, request_id: str, request: str) -> str:
        return self._host().stage(request_id, request)

    def pending(self) -> int:
        return self._host().pending()

    def progress(self) -> None:
        """Drive this rank's NIXL agent: in one process, decode's READs complete only while it is polled."""
        self._host().poll()

    def teardown(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
            gc.collect()

    def stop(self) -> None:
        self.teardown()


def _serve_prefill(conn: Connection) -> None:
    """A prefill process: runs the commands of :class:`ProcessPrefill`, driving NIXL progress between them."""
    os.dup2(2, 1)  # the parent's stdout carries only its result
    local = LocalPrefill()
    conn.send(("ready", None))
    while True:
        if local.host is None or conn.poll(0.0005):
            command, args = conn.recv()
        else:
            local.host.poll()  # notifications; decode's READs need no help from here (CMA reads this memory)
            continue
        if command == "stop":
            local.stop()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(local, command)(*args)))
        except Exception as exc:  # reported to the parent, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessPrefill:
    """A prefill rank in its own process (started once, reused by every case)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve_prefill, args=(child,), daemon=True)
        self.process.start()

    def wait_ready(self, timeout: float = 300.0) -> None:
        if not self.conn.poll(timeout):
            raise RuntimeError("a prefill process did not start")
        self.conn.recv()

    def _call(self, command: str, *args: Any) -> Any:
        self.conn.send((command, args))
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"prefill process, {command}: {value}")
        return value

    def setup(
        self,
        allocate: Allocate,
        model: ModelGeometry,
        case: Case,
        rank: int,
        num_blocks: int,
        tag: str,
        staging: bool = False,
    ) -> Handshake:
        metadata: Handshake = self._call("setup", allocate, model, case, rank, num_blocks, tag, staging)
        return metadata

    def offer(self, request_id: str, blocks: list[int], num_tokens: int) -> list[int]:
        ids: list[int] = self._call("offer", request_id, blocks, num_tokens)
        return ids

    def stage(self, request_id: str, request: str) -> str:
        return str(self._call("stage", request_id, request))

    def pending(self) -> int:
        return int(self._call("pending"))

    def progress(self) -> None:
        """Nothing: the process drives its own agent."""

    def teardown(self) -> None:
        self._call("teardown")

    def stop(self) -> None:
        with suppress(OSError, EOFError, RuntimeError):
            self._call("stop")
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
