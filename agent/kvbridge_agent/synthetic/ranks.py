"""The synthetic engine's rank processes as the engine sees them, its free blocks, and its errors.

``RankHandle`` is the engine's end of one rank process (calls with ids and timeouts, events to a callback);
``BlockAllocator`` hands out free blocks, contiguous or scattered; ``EngineError`` carries a stable code and the
HTTP status the engine API answers with.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.contract import BlockAllocation

# Stable error codes of the engine API (documented in docs/troubleshooting.md).
NO_FREE_BLOCKS = "NO_FREE_BLOCKS"
DUPLICATE_REQUEST = "DUPLICATE_REQUEST"
RANK_FAILED = "RANK_FAILED"
RANK_TIMEOUT = "RANK_TIMEOUT"
INVALID_REQUEST = "INVALID_REQUEST"
STARTUP_FAILED = "STARTUP_FAILED"

RANK_START_TIMEOUT = 180.0
#: how long ranks get to stop by themselves on shutdown, all together, before they are terminated and killed
SHUTDOWN_GRACE_SECONDS = 3.0


def join_all(processes: list[Any], budget: float) -> None:
    """Wait for all the processes, ``budget`` seconds in all."""
    deadline = time.monotonic() + budget
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


class EngineError(KVBridgeError):
    code = "ENGINE_ERROR"

    def __init__(
        self, message: str, *, code: str, field: str = "", status: int = 400, invalid_blocks: list[int] | None = None
    ) -> None:
        super().__init__(message, field=field, code=code)
        self.status = status
        self.invalid_blocks = invalid_blocks or []


class BlockAllocator:
    """Free blocks of one engine: ``Sequential`` hands out the lowest free ids (contiguous on a fresh engine),
    ``Scattered`` random free ids in random order (seeded), the way a long-running engine's fragmented free
    list gives them. Each request may override the engine's default."""

    def __init__(self, num_blocks: int, *, default: BlockAllocation = BlockAllocation.SEQUENTIAL) -> None:
        self.num_blocks = num_blocks
        self.default = default
        self._free = np.ones(num_blocks, dtype=bool)
        self._count = num_blocks
        self._rng = np.random.default_rng(num_blocks)
        self._lock = threading.Lock()

    def allocate(self, count: int, allocation: BlockAllocation | None = None) -> list[int]:
        with self._lock:
            if count > self._count:
                raise EngineError(
                    f"{count} blocks needed, {self._count} of {self.num_blocks} free",
                    code=NO_FREE_BLOCKS,
                    status=503,
                )
            free = np.flatnonzero(self._free)
            if (allocation or self.default) is BlockAllocation.SCATTERED:
                chosen = self._rng.choice(free, size=count, replace=False)
            else:
                chosen = free[:count]
            self._free[chosen] = False
            self._count -= count
            return [int(b) for b in chosen]

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            ids = np.unique(np.asarray(blocks, dtype=np.int64))
            self._count += int(np.count_nonzero(~self._free[ids]))
            self._free[ids] = True

    @property
    def free_count(self) -> int:
        return self._count


class RankHandle:
    """The engine's end of one rank process: calls with ids and timeouts, events to a callback."""

    def __init__(self, rank: int, process: Any, conn: Connection, on_event: Any, on_gone: Any = None) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self._on_event = on_event
        self._on_gone = on_gone
        self._ids = itertools.count()
        self._waiting: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.ready: Future[dict[str, Any]] = Future()
        self._reader = threading.Thread(target=self._read, name=f"rank{rank}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if "id" in message:
                future = self._waiting.pop(message["id"], None)
                if future is not None:
                    future.set_result(message)
            elif message.get("event") in ("ready", "failed") and not self.ready.done():
                self.ready.set_result(message)
            else:
                self._on_event(self.rank, message)
        gone = {"ok": False, "code": RANK_FAILED, "message": f"rank {self.rank} process exited"}
        if not self.ready.done():
            self.ready.set_result({"event": "failed", "code": RANK_FAILED, "message": gone["message"]})
        for future in list(self._waiting.values()):
            future.set_result(gone)
        self._waiting.clear()
        self.process.join(timeout=5)  # reap it: no zombie rank
        if self._on_gone is not None:
            self._on_gone(self.rank)

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            self.conn.send(message)

    def call_async(self, message: dict[str, Any]) -> Future[dict[str, Any]]:
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            ident = next(self._ids)
            self._waiting[ident] = future
            try:
                self.conn.send({**message, "id": ident})
            except (OSError, ValueError):
                self._waiting.pop(ident, None)
                future.set_result({"ok": False, "code": RANK_FAILED, "message": f"rank {self.rank} is gone"})
        return future

    def call(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        return wait_reply(self.rank, self.call_async(message), timeout)


def wait_reply(rank: int, future: Future[dict[str, Any]], timeout: float) -> dict[str, Any]:
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        return {"ok": False, "code": RANK_TIMEOUT, "message": f"rank {rank} did not answer within {timeout:g} s"}
