"""The engines of one pod: one :class:`~kvbridge_agent.synthetic.engine.Engine` per data-parallel rank.

A pod of the synthetic engine runs ``dataParallelSize`` DP ranks, as one vLLM engine with data parallelism does
(``kvbridge_agent.core.parallel``): each rank its own TP rank processes, its own KV cache of ``numBlocks`` blocks,
its own engine id (``<pod>_dp<rank>``) and its own side channel (base port + rank), so to the other role each DP
rank is a transfer peer of its own. The pod's one HTTP API spreads requests over its ranks the way vLLM's internal
load balancing does (the rank with the fewest requests in flight, ties in turn); a request may name its rank with
vLLM's header ``X-data-parallel-rank``. One DP rank (the default) is the plain engine under the pod's name.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from kvbridge_agent.core.contract import BlockAllocation, EngineEnvironment
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.synthetic.engine import Engine
from kvbridge_agent.synthetic.pace import Pace, Pacer
from kvbridge_agent.synthetic.ranks import DUPLICATE_REQUEST, INVALID_REQUEST, EngineError
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.metrics import AgentMetrics

log = logging.getLogger(__name__)

#: vLLM's header naming the DP rank a request runs on (its OpenAI server reads the same)
DP_RANK_HEADER = "X-data-parallel-rank"


class DataParallelEngines:
    """The pod's DP ranks behind one HTTP API: start and stop them together, pick one per request."""

    def __init__(
        self,
        env: EngineEnvironment,
        keys: CurveKeys | None = None,
        log_level: str = "WARNING",
        pace: Pace | None = None,
    ) -> None:
        self.env = env
        self.pace = Pacer(pace or Pace(), env.role)  # the OpenAI routes' set speed, and the vllm: series (pace.py)
        metrics = AgentMetrics(env.role.value, env.engine_id)
        self.metrics = metrics
        self.members = [
            Engine(member, keys, log_level, metrics.relabelled(member.engine_id))
            for member in (
                [env.of_data_parallel_rank(r) for r in range(env.own.data_parallel_size)]
                if env.own.data_parallel_size > 1
                else [env]  # one DP rank: the engine as its environment says (KVBRIDGE_DP_INDEX included)
            )
        ]
        self._lock = threading.Lock()
        self._in_flight = [0] * len(self.members)
        self._turn = itertools.cycle(range(len(self.members)))
        self._prefilling: set[str] = set()

    @property
    def transfer_token(self) -> bytes | None:
        return self.members[0].transfer_token

    @property
    def incarnation(self) -> str:
        """The first rank's incarnation (each rank has its own: :meth:`data_parallel_ranks`)."""
        return self.members[0].incarnation

    # -- lifetime -------------------------------------------------------------
    def start(self) -> DataParallelEngines:
        """Start every rank's processes and side channel at once; any failure stops them all and is raised."""
        with ThreadPoolExecutor(len(self.members), thread_name_prefix="dp-start") as pool:
            started = [pool.submit(member.start) for member in self.members]
            failures = [(rank, f.exception()) for rank, f in enumerate(started) if f.exception() is not None]
        if failures:
            for rank, error in failures:
                log.error("DP rank %d of %s did not start: %s", rank, self.env.engine_id, error)
            try:
                self.close()
            except Exception:  # the start's failure is what the caller needs to see
                log.exception("stopping the DP ranks of %s after a failed start", self.env.engine_id)
            raise failures[0][1]  # type: ignore[misc]
        return self

    def close(self) -> None:
        """Stop every rank (each within its own shutdown budget, all at once); idempotent."""
        with ThreadPoolExecutor(len(self.members), thread_name_prefix="dp-close") as pool:
            list(pool.map(lambda member: member.close(), self.members))

    def problems(self) -> list[str]:
        if len(self.members) == 1:
            return self.members[0].problems()
        return [f"DP rank {rank}: {p}" for rank, member in enumerate(self.members) for p in member.problems()]

    @property
    def healthy(self) -> bool:
        return all(member.healthy for member in self.members)

    def rank_pids(self) -> list[int]:
        return [pid for member in self.members for pid in member.rank_pids()]

    def data_parallel_ranks(self) -> list[dict[str, Any]]:
        """Each DP rank as a transfer peer: engine id, incarnation, side-channel port (prefill)."""
        return [
            {
                "rank": rank,
                "engineId": member.env.engine_id,
                "incarnation": member.incarnation,
                "sideChannelPort": member.server.port if member.server else None,
            }
            for rank, member in enumerate(self.members)
        ]

    # -- state ------------------------------------------------------------------
    def held(self) -> dict[str, list[int]]:
        """Prefill requests awaiting readers, on every rank (request ids are unique across the pod's ranks)."""
        return {rid: blocks for member in self.members for rid, blocks in member.held().items()}

    @property
    def free_blocks(self) -> int:
        return sum(member.allocator.free_count for member in self.members)

    def rank_stats(self) -> list[dict[str, Any]]:
        return [
            dict(stats, dataParallelRank=r) for r, member in enumerate(self.members) for stats in member.rank_stats()
        ]

    # -- requests -----------------------------------------------------------------
    def rank_of(self, header: str | None) -> int | None:
        """The DP rank a request names in :data:`DP_RANK_HEADER` (None: any), or a 400 naming the valid ranks."""
        if header is None:
            return None
        last = len(self.members) - 1
        try:
            rank = int(header)
        except ValueError:
            rank = -1
        if not 0 <= rank <= last:
            raise EngineError(
                f"{DP_RANK_HEADER} must be a DP rank of this engine, 0..{last}, got {header!r}",
                code=INVALID_REQUEST,
                field=DP_RANK_HEADER,
            )
        return rank

    @contextmanager
    def _on(self, rank: int | None) -> Iterator[Engine]:
        """The named rank, else the one with the fewest requests in flight (ties in turn), for one request."""
        with self._lock:
            if rank is None:
                turn = next(self._turn)
                order = [(turn + i) % len(self.members) for i in range(len(self.members))]
                rank = min(order, key=lambda r: self._in_flight[r])
            self._in_flight[rank] += 1
        try:
            yield self.members[rank]
        finally:
            with self._lock:
                self._in_flight[rank] -= 1

    def prefill(
        self, request_id: str, num_tokens: int, allocation: BlockAllocation | None = None, rank: int | None = None
    ) -> KVTransferParams:
        """Compute and offer a request on one rank; its parameters name that rank's engine id and side channel."""
        with self._lock:  # a request id is held once per pod, whichever rank holds it
            if request_id in self._prefilling or any(m.holds(request_id) for m in self.members):
                raise EngineError(
                    f"request {request_id} is already held", code=DUPLICATE_REQUEST, status=409, field="requestId"
                )
            self._prefilling.add(request_id)
        try:
            with self._on(rank) as member:
                return member.prefill(request_id, num_tokens, allocation)
        finally:
            with self._lock:
                self._prefilling.discard(request_id)

    def decode(
        self,
        request_id: str,
        params: KVTransferParams,
        prefix_hit_blocks: int = 0,
        allocation: BlockAllocation | None = None,
        rank: int | None = None,
    ) -> dict[str, Any]:
        """Read a request's KV on one rank, from the prefill DP rank its parameters name."""
        with self._on(rank) as member:
            result = member.decode(request_id, params, prefix_hit_blocks, allocation)
        if len(self.members) > 1:
            result["dataParallelRank"] = member.env.dp_index
        return result
