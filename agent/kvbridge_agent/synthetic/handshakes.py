"""Decode's prefill engines in the synthetic engine: one handshake in flight per engine (every rank told the
prefill ranks it reads), a restarted engine's old incarnations retired, and an engine evicted on every rank."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvbridge_agent.core.admission import REMOTE_HOST_NOT_ALLOWED
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.core.tp import handshake_ranks
from kvbridge_agent.synthetic.ranks import EngineError, RankHandle, wait_reply
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.metrics import AgentMetrics
from kvbridge_agent.transfer.peers import (
    STALE_PEER,
    PrefillService,
    fetch_prefill_ranks,
    require_address,
    require_incarnation,
)


@dataclass
class PeerState:
    incarnation: str
    future: Future[None]
    #: the side channel the handshake went to (host, port)
    address: tuple[str, int]


class PrefillPeers:
    """The prefill engines one decode engine met, and the handshakes with them."""

    def __init__(
        self,
        env: EngineEnvironment,
        fingerprint: str,
        keys: CurveKeys | None,
        metrics: AgentMetrics,
        ranks: Callable[[], list[RankHandle]],
    ) -> None:
        self.env, self.fingerprint, self.keys, self.metrics, self.ranks = env, fingerprint, keys, metrics, ranks
        self._peers: dict[str, PeerState] = {}
        self._peers_lock = threading.Lock()
        self._current: dict[str, str] = {}  # engine id -> incarnation of the last successful handshake
        self._retired: dict[str, deque[str]] = {}  # engine id -> incarnations known to be gone
        #: the deployment's prefill pods (KVBRIDGE_PREFILL_SERVICE): the only side channels decode connects to
        self.service = PrefillService(env.prefill_service, env.transfer.handshake_timeout_seconds)

    def ensure(self, params: KVTransferParams) -> None:
        """Handshake with a prefill engine unless its current incarnation is known; one in flight per engine."""
        if params.remote_incarnation in self._retired.get(params.remote_engine_id, ()):
            raise EngineError(
                f"{params.remote_engine_id} restarted since incarnation {params.remote_incarnation} computed this "
                "request: its blocks are gone",
                code=STALE_PEER,
                status=409,
            )
        with self._peers_lock:
            known = self._peers.get(params.remote_engine_id)
            fresh = known is None or (
                known.future.done()
                and (known.future.exception() is not None or known.incarnation != params.remote_incarnation)
            )
            if known is None or fresh:
                known = PeerState(params.remote_incarnation, Future(), (params.remote_host, params.remote_port))
                self._peers[params.remote_engine_id] = known
            state = known
        if fresh:
            try:
                self._handshake(params)
            except BaseException as exc:
                state.future.set_exception(exc)
            else:
                state.future.set_result(None)
        try:
            state.future.result(timeout=self.env.transfer.handshake_timeout_seconds * 3 + 30)
        except HandshakeError as exc:  # a host outside the prefill Service is the request's fault: 400
            status = 400 if exc.code == REMOTE_HOST_NOT_ALLOWED else 502
            raise EngineError(exc.message, code=exc.code, status=status, field=exc.field) from exc
        except EngineError:
            raise
        except TimeoutError as exc:
            raise EngineError("handshake still in flight", code="HANDSHAKE_TIMEOUT", status=504) from exc
        try:
            require_incarnation(params, state.incarnation)
            require_address(params, state.address)
        except HandshakeError as exc:
            raise EngineError(exc.message, code=exc.code, status=409 if exc.code == STALE_PEER else 502) from exc

    def _handshake(self, params: KVTransferParams) -> None:
        started = time.perf_counter()
        tp_d = self.env.own.tensor_parallel_size
        needed = sorted({p for d in range(tp_d) for p in handshake_ranks(params.remote_tp_size, tp_d, d)})
        timeout = self.env.transfer.handshake_timeout_seconds
        incarnation, ranks = fetch_prefill_ranks(params, needed, self.fingerprint, self.keys, timeout, self.service)
        gone = {self._current.get(params.remote_engine_id), params.remote_incarnation} - {None, incarnation}
        for old in gone:
            if old is not None:
                self._retired.setdefault(params.remote_engine_id, deque(maxlen=64)).append(old)
        self.evict(params.remote_engine_id, keep_state=True)
        futures = []
        for handle in self.ranks():
            mine = handshake_ranks(params.remote_tp_size, tp_d, handle.rank)
            payload = {p: (ranks[p][0].model_dump_json(), ranks[p][1]) for p in mine}
            futures.append(
                handle.call_async(
                    {
                        "op": "add_peer",
                        "engine_id": params.remote_engine_id,
                        "incarnation": incarnation,
                        "ranks": payload,
                    }
                )
            )
        for handle, future in zip(self.ranks(), futures, strict=True):
            reply = wait_reply(handle.rank, future, 60)
            if not reply.get("ok"):
                self.evict(params.remote_engine_id, keep_state=True)
                raise HandshakeError(
                    f"rank {handle.rank}: {reply.get('message')}", code=reply.get("code", "PEER_INCOMPATIBLE")
                )
        with self._peers_lock:
            state = self._peers.get(params.remote_engine_id)
            if state is not None:
                state.incarnation = incarnation
            self._current[params.remote_engine_id] = incarnation
        self.metrics.handshake_seconds.labels(**self.metrics.labels).observe(time.perf_counter() - started)

    def evict(self, engine_id: str, keep_state: bool = False) -> None:
        """Evict a prefill engine on every rank (its remote agents and descriptor lists)."""
        if not keep_state:
            with self._peers_lock:
                self._peers.pop(engine_id, None)
        evicted = False
        for handle in self.ranks():
            reply = handle.call({"op": "evict_peer", "engine_id": engine_id}, timeout=30)
            evicted = evicted or bool(reply.get("evicted"))
        if evicted:
            self.metrics.stale_evictions.labels(**self.metrics.labels).inc()
