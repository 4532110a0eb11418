"""The agent worker's engine process: TP rank processes, block allocation, side channel, leases.

A prefill engine allocates a request's blocks, has every rank "compute" and
offer them, publishes ``kv_transfer_params``, and frees the blocks when
every rank saw all its readers' notifications or the lease expired.  A
decode engine handshakes once per prefill engine (one handshake in flight
per engine; a new incarnation evicts the stale one first), has every rank
READ its part, and reports per request: done, or failed with a code and the
local blocks that are invalid.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.core import build_plan, wire_block_ids
from kvbridge_agent.core.admission import INVALID_TRANSFER_PARAMS, Admission, PrefillHosts, TransferRefusedError
from kvbridge_agent.core.blocks import blocks_for_tokens
from kvbridge_agent.core.contract import BlockAllocation, EngineEnvironment
from kvbridge_agent.core.digest import (
    KV_DIGEST_UNAVAILABLE,
    HeadDigests,
    RequestDigests,
    VerificationPolicy,
    decode_verifies,
    from_bytes,
    new_key,
    to_bytes,
)
from kvbridge_agent.core.handshake import (
    INVALID_REQUEST_ID,
    DigestState,
    HandshakeError,
    KVTransferParams,
    RankMetadata,
    TransferDigests,
    request_id_problem,
)
from kvbridge_agent.core.model import Role
from kvbridge_agent.core.plan import PeerTensorParallel
from kvbridge_agent.core.signing import load_token
from kvbridge_agent.synthetic.decode_answer import answer
from kvbridge_agent.synthetic.handshakes import PrefillPeers
from kvbridge_agent.synthetic.rank_entry import main as rank_main
from kvbridge_agent.synthetic.ranks import (
    DUPLICATE_REQUEST,
    INVALID_REQUEST,
    RANK_FAILED,
    RANK_START_TIMEOUT,
    RANK_TIMEOUT,
    SHUTDOWN_GRACE_SECONDS,
    STARTUP_FAILED,
    BlockAllocator,
    EngineError,
    RankHandle,
    join_all,
    wait_reply,
)
from kvbridge_agent.synthetic.stage_requests import stage_host, stage_on_rank
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.metrics import AgentMetrics
from kvbridge_agent.transfer.peers import (
    LEASE_CLOCK_MARGIN_SECONDS,
    LEASE_EXPIRED,
    fetch_digests,
    lease_left,
    renew_leases,
)
from kvbridge_agent.transfer.side_channel import SideChannelServer, heartbeat_interval

log = logging.getLogger(__name__)


@dataclass
class _Held:
    blocks: list[int]
    deadline: float
    done_ranks: set[int] = field(default_factory=set)
    #: the key and what the ranks digested at offer, for decode to verify (None: not verified)
    digests: RequestDigests | None = None


class Engine:
    """One prefill or decode engine of the agent worker."""

    def __init__(
        self,
        env: EngineEnvironment,
        keys: CurveKeys | None = None,
        log_level: str = "WARNING",
        metrics: AgentMetrics | None = None,
    ) -> None:
        self._verification = VerificationPolicy(env.transfer)
        self.env = env
        self.keys = keys
        #: decode: the router's token (spec.router.signTransfers): transfer parameters without its signature get 403
        self.transfer_token = (
            load_token(env.transfer_token_file) if env.transfer_token_file and env.role is Role.DECODE else None
        )
        self.log_level = log_level
        self.incarnation = uuid.uuid4().hex[:12]
        self.metrics = metrics or AgentMetrics(env.role.value, env.engine_id)
        self.allocator = BlockAllocator(env.num_blocks, default=env.block_allocation)
        self.plan = build_plan(env.model, env.prefill, env.decode, env.transfer)
        self.max_tokens = env.num_blocks * env.own.block_size  # the synthetic model's length: what its cache holds
        #: decode: its deployment's bounds on transfer parameters: prefill TPs, the model's length, prefill hosts
        peer_tp = PeerTensorParallel(env.model, env.prefill, env.decode, env.transfer)
        hosts = PrefillHosts(env.prefill_hosts or ())
        self._admission = Admission(peer_tp, self.max_tokens, self.plan.wire.block_size, hosts)
        self.ranks: list[RankHandle] = []
        self.server: SideChannelServer | None = None
        self._held: dict[str, _Held] = {}
        self._held_lock = threading.Lock()
        #: decode: the prefill engines met (a handshake each, on every rank)
        self.peers = PrefillPeers(env, self.plan.fingerprint, keys, self.metrics, lambda: self.ranks)
        self._waiting: dict[str, KVTransferParams] = {}  # decode requests still waiting (heartbeats)
        self._renewed: dict[str, float] = {}  # decode request -> when its last acknowledged heartbeat was sent
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.ready = False
        #: set when a rank process died while the engine was serving (the engine cannot serve without it)
        self.failure: str | None = None

    @property
    def tp_size(self) -> int:
        return self.env.own.tensor_parallel_size

    # -- lifetime -------------------------------------------------------------
    def start(self) -> Engine:
        context = multiprocessing.get_context("spawn")
        env_json = self.env.model_dump_json()
        for rank in range(self.tp_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=rank_main,
                args=(env_json, rank, self.incarnation, child, self.log_level),
                name=f"{self.env.engine_id}-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.ranks.append(RankHandle(rank, process, parent, self._on_event, self._on_rank_gone))
        for handle in self.ranks:
            try:
                ready = handle.ready.result(timeout=RANK_START_TIMEOUT)
            except TimeoutError:
                ready = {"event": "failed", "code": RANK_TIMEOUT, "message": "did not start in time"}
            if ready.get("event") != "ready":
                self.close()
                raise EngineError(
                    f"rank {handle.rank} failed to start: {ready.get('message')}", code=STARTUP_FAILED, status=500
                )
        if self.env.role is Role.PREFILL:
            ranks: dict[int, tuple[RankMetadata, bytes]] = {}
            for handle in self.ranks:
                reply = handle.call({"op": "metadata"}, timeout=30)
                if not reply.get("ok"):
                    self.close()
                    raise EngineError(f"rank {handle.rank}: {reply.get('message')}", code=STARTUP_FAILED)
                ranks[handle.rank] = (RankMetadata.model_validate_json(reply["metadata"]), reply["agent"])
            self.server = SideChannelServer(
                self.env.side_channel_host,
                self.env.side_channel_port,
                self.plan.fingerprint,
                ranks,
                keys=self.keys,
                on_heartbeat=self.heartbeat,
                digests=self._published_digests,
                on_stage=lambda request_id, request: stage_on_rank(self.ranks, request_id, request),
            ).start()
            self._spawn(self._expire_leases, "leases")
        else:
            self._spawn(self._send_heartbeats, "heartbeats")
        self.metrics.free_blocks.labels(**self.metrics.labels).set(self.allocator.free_count)
        self.ready = True
        return self

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Stop ranks (shutdown, then terminate, then kill) and the side channel; idempotent."""
        self._stop.set()
        self.ready = False
        for handle in self.ranks:
            with contextlib.suppress(OSError, ValueError):
                handle.send({"op": "shutdown"})
        # one budget for all ranks together (not per rank): graceful, then SIGTERM, then SIGKILL
        processes = [h.process for h in self.ranks]
        join_all(processes, SHUTDOWN_GRACE_SECONDS)
        for escalate in ("terminate", "kill"):
            alive = [p for p in processes if p.is_alive()]
            for process in alive:
                getattr(process, escalate)()
            join_all(alive, 2.0)
        for handle in self.ranks:
            handle.conn.close()
        self.ranks = []
        if self.server is not None:
            self.server.close()
            self.server = None

    def _on_rank_gone(self, rank: int) -> None:
        if not self._stop.is_set() and self.failure is None:
            code = self.ranks[rank].process.exitcode if rank < len(self.ranks) else None
            by_signal = f" (signal {-code})" if code is not None and code < 0 else ""  # a native fault: SIGSEGV is 11
            self.failure = f"rank {rank} process exited with code {code}{by_signal}"
            log.error("engine %s: %s; the engine must be restarted", self.env.engine_id, self.failure)

    def problems(self) -> list[str]:
        """Why the engine cannot serve: a dead rank, a stopped side-channel listener (empty: healthy)."""
        found = [self.failure] if self.failure else []
        if self.server is not None and not self.server.alive:
            found.append(self.server.failure or "side-channel listener is not running")
        return found

    @property
    def healthy(self) -> bool:
        return self.ready and not self.problems()

    def rank_pids(self) -> list[int]:
        return [h.process.pid for h in self.ranks if h.process.pid is not None]

    # -- events from ranks ----------------------------------------------------
    def _on_event(self, rank: int, message: dict[str, Any]) -> None:
        event = message.get("event")
        if event == "complete":
            self._rank_done(message["request_id"], rank)
        elif event == "notifications":
            labels = self.metrics.labels
            if message.get("unknown"):
                self.metrics.failed_notifications.labels(**labels, reason="unknown").inc(message["unknown"])
            if message.get("malformed"):
                self.metrics.failed_notifications.labels(**labels, reason="malformed").inc(message["malformed"])

    def _rank_done(self, request_id: str, rank: int) -> None:
        with self._held_lock:
            held = self._held.get(request_id)
            if held is None:
                return
            held.done_ranks.add(rank)
            if len(held.done_ranks) < self.tp_size:
                return
            del self._held[request_id]
        self._free(held.blocks)

    def _free(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)
        self.metrics.free_blocks.labels(**self.metrics.labels).set(self.allocator.free_count)
        self._report_held()

    def _report_held(self) -> None:
        """The held requests and the bytes of their blocks, for autoscalers (scale down the pod holding least)."""
        with self._held_lock:
            requests, blocks = len(self._held), sum(len(h.blocks) for h in self._held.values())
        labels = self.metrics.labels
        self.metrics.held_requests.labels(**labels).set(requests)
        self.metrics.held_bytes.labels(**labels).set(
            blocks * self.env.prefill.block_size * self.env.model.kv_bytes_per_token
        )

    # -- prefill ----------------------------------------------------------------
    def prefill(self, request_id: str, num_tokens: int, allocation: BlockAllocation | None = None) -> KVTransferParams:
        """Compute (synthetically) and offer a request; returns what decode needs to pull it."""
        if self.env.role is not Role.PREFILL:
            raise EngineError("this is a decode engine", code=INVALID_REQUEST, field="role")
        problem = request_id_problem(request_id)
        if problem:  # checked before anything is allocated or held for it
            raise EngineError(problem, code=INVALID_REQUEST_ID, field="requestId")
        if not 1 <= num_tokens <= self.max_tokens:  # the synthetic model's length
            raise EngineError(f"numTokens must be within 1..{self.max_tokens}", code=INVALID_REQUEST, field="numTokens")
        blocks = self.allocator.allocate(blocks_for_tokens(num_tokens, self.env.prefill.block_size), allocation)
        with self._held_lock:
            if request_id in self._held:
                self.allocator.free(blocks)
                raise EngineError(
                    f"request {request_id} is already held", code=DUPLICATE_REQUEST, status=409, field="requestId"
                )
            self._held[request_id] = _Held(blocks, math.inf)  # the lease starts when the blocks are offered
        verify = self._verification.decide()  # a secret draw: the client's request id does not enter it
        key = new_key() if verify else b""
        futures = [
            h.call_async(
                {
                    "op": "offer",
                    "request_id": request_id,
                    "blocks": blocks,
                    "digest_tokens": num_tokens if verify else 0,
                    "digest_key": key,
                }
            )
            for h in self.ranks
        ]
        digests: HeadDigests = {}
        for handle, future in zip(self.ranks, futures, strict=True):
            reply = wait_reply(handle.rank, future, 60)
            if not reply.get("ok"):
                self._drop_held(request_id)
                raise EngineError(
                    f"rank {handle.rank}: {reply.get('message')}", code=reply.get("code", RANK_FAILED), status=500
                )
            digests.update(from_bytes(reply.get("digestHeads", []), reply.get("digest", b"")))
        lease = self.env.transfer.lease_seconds
        with self._held_lock:  # published now: the lease runs from here, not from the allocation before compute
            held = self._held.get(request_id)
            if held is not None:
                held.deadline = time.monotonic() + lease
                held.digests = RequestDigests(key, digests) if verify else None
        expires_at = time.time() + lease
        self._report_held()
        self.metrics.free_blocks.labels(**self.metrics.labels).set(self.allocator.free_count)
        wire = wire_block_ids(blocks, num_tokens, self.plan.split_ratio, self.plan.wire.block_size)
        return KVTransferParams(
            remote_engine_id=self.env.engine_id,
            remote_incarnation=self.incarnation,
            remote_host=self.env.side_channel_host,
            remote_port=self.server.port if self.server else self.env.side_channel_port,
            remote_request_id=request_id,
            remote_block_ids=wire.tolist(),
            num_tokens=num_tokens,
            remote_tp_size=self.tp_size,
            fingerprint=self.plan.fingerprint,
            expires_at=expires_at,
            verify=verify,
            lease_token=self.server.token(request_id) if self.server else "",
            digests=TransferDigests.of(RequestDigests(key, digests)) if verify else None,
        )

    def _published_digests(self, request_id: str) -> tuple[DigestState, RequestDigests | None]:
        """The side channel's answer to a decode asking for a request's digests."""
        with self._held_lock:
            held = self._held.get(request_id)
            if held is None or held.digests is None:
                return DigestState.UNKNOWN, None
            return DigestState.READY, held.digests

    def _drop_held(self, request_id: str) -> None:
        with self._held_lock:
            held = self._held.pop(request_id, None)
        if held is not None:
            self._release(request_id, held)

    def _release(self, request_id: str, held: _Held) -> None:
        """Free a request no longer held: its ranks forget it, its blocks go back."""
        for handle in self.ranks:
            handle.send({"op": "forget", "request_id": request_id})
        self._free(held.blocks)

    def heartbeat(self, request_ids: list[str]) -> list[str]:
        """Renew the leases of requests a decode engine still waits on; returns those renewed (still held)."""
        now = time.monotonic()
        deadline = now + self.env.transfer.lease_seconds
        renewed = []
        with self._held_lock:
            for request_id in request_ids:
                held = self._held.get(request_id)
                if held is not None and held.deadline > now:  # an ended lease is freed, not renewed
                    held.deadline = max(held.deadline, deadline)
                    renewed.append(request_id)
        return renewed

    def _expire_leases(self) -> None:
        while not self._stop.wait(0.1):
            now = time.monotonic()
            with self._held_lock:  # taken out under the lock: a heartbeat cannot renew what is being freed
                expired = [(rid, held) for rid, held in self._held.items() if held.deadline < now]
                for request_id, _ in expired:
                    del self._held[request_id]
            for request_id, held in expired:
                log.warning("lease of request %s expired; freeing its blocks", request_id)
                self.metrics.expired_leases.labels(**self.metrics.labels).inc()
                self._release(request_id, held)

    def holds(self, request_id: str) -> bool:
        with self._held_lock:
            return request_id in self._held

    def held(self) -> dict[str, list[int]]:
        with self._held_lock:
            return {rid: list(held.blocks) for rid, held in self._held.items()}

    # -- decode -----------------------------------------------------------------
    def decode(
        self,
        request_id: str,
        params: KVTransferParams,
        prefix_hit_blocks: int = 0,
        allocation: BlockAllocation | None = None,
    ) -> dict[str, Any]:
        """Pull a request's KV from its prefill engine; every rank reads its part and verifies it."""
        if self.env.role is not Role.DECODE:
            raise EngineError("this is a prefill engine", code=INVALID_REQUEST, field="role")
        try:  # before anything is allocated, recorded or connected to
            self._admission.check(params, "kvTransferParams")
        except TransferRefusedError as exc:  # out of bounds: the engine's INVALID_REQUEST, as the schema's
            code = INVALID_REQUEST if exc.code == INVALID_TRANSFER_PARAMS else exc.code
            raise EngineError(exc.message, code=code, field=exc.field) from None
        total = blocks_for_tokens(params.num_tokens, self.env.decode.block_size)
        if not 0 <= prefix_hit_blocks <= total:
            raise EngineError(
                f"prefixHitBlocks must be within 0..{total}", code=INVALID_REQUEST, field="prefixHitBlocks"
            )
        blocks = self.allocator.allocate(total, allocation)
        self._waiting[request_id] = params
        started = time.perf_counter()
        labels = self.metrics.labels
        try:
            self.peers.ensure(params)  # first: a restarted prefill (STALE_PEER) says more than an expired lease
            self._check_lease(request_id, params, "before reading")
            # prefill's draw (the parameters' verify), or decode's own policy when it is All
            verify = decode_verifies(self.env.transfer, params.verify)
            expected = self._expected_digests(params) if verify else None
            futures = [
                h.call_async(
                    {
                        "op": "read",
                        "request_id": request_id,
                        "params": params.model_dump_json(),
                        "blocks": blocks,
                        "hit": prefix_hit_blocks,
                        "expected": expected,
                        "stage_host": stage_host(self.peers.service, params),
                    }
                )
                for h in self.ranks
            ]
            limit = self.env.transfer_timeout_seconds + 30
            replies = [wait_reply(h.rank, f, limit) for h, f in zip(self.ranks, futures, strict=True)]
            if all(r.get("ok") for r in replies):  # prefill may have reused blocks a late read copied
                self._check_lease(request_id, params, "after reading")
        except EngineError as exc:
            self.metrics.failed_transfers.labels(**labels, code=exc.code).inc()
            self.metrics.requests.labels(**labels, outcome="failed").inc()
            exc.invalid_blocks = blocks[prefix_hit_blocks:]
            raise
        finally:
            self._waiting.pop(request_id, None)
            self._renewed.pop(request_id, None)
            self.allocator.free(blocks)
        if any(not r.get("ok") and r.get("peerFailed") for r in replies):
            self.peers.evict(params.remote_engine_id)
        return answer(self.metrics, self.env.verify, request_id, params, replies, started)

    def _expected_digests(self, params: KVTransferParams) -> tuple[list[int], bytes, bytes]:
        """Prefill's digests of the request, as the ranks get them: ``(heads, bytes, key)``: those its parameters
        carry, else from its side channel."""
        if params.digests is not None:
            try:
                carried = params.digests.request_digests()
            except ValueError as exc:
                raise EngineError(f"the parameters' digests: {exc}", code=KV_DIGEST_UNAVAILABLE, status=400) from exc
            return (*to_bytes(carried.heads), carried.key)
        until = params.expires_at if params.expires_at is not None else time.time()
        try:
            timeout = self.env.transfer.handshake_timeout_seconds
            digests = fetch_digests(params, self.plan.fingerprint, self.keys, timeout, until, self.peers.service)
        except HandshakeError as exc:
            status = 410 if exc.code == KV_DIGEST_UNAVAILABLE else 502
            raise EngineError(
                f"prefill's digests of {params.remote_request_id}: {exc.message}", code=exc.code, status=status
            ) from exc
        return (*to_bytes(digests.heads), digests.key)

    def _check_lease(self, request_id: str, params: KVTransferParams, when: str) -> None:
        """Refuse a read outside prefill's lease: the expiry the params carry, or later renewals by this engine's
        heartbeats, minus :data:`LEASE_CLOCK_MARGIN_SECONDS` for clock skew (params without an expiry: no check)."""
        if params.expires_at is None:
            return
        renewed = self._renewed.get(request_id, -math.inf) + self.env.transfer.lease_seconds
        left = lease_left(max(params.expires_at, renewed))
        if left <= 0:
            raise EngineError(
                f"prefill's lease on request {params.remote_request_id} ended {-left:.1f} s {when} (expiry "
                f"{params.expires_at:.1f} less a {LEASE_CLOCK_MARGIN_SECONDS:g} s clock margin): prefill may have "
                "freed and reused its blocks; prefill it again",
                code=LEASE_EXPIRED,
                status=410,
            )

    def _send_heartbeats(self) -> None:
        while not self._stop.wait(heartbeat_interval(self.env.transfer.lease_seconds)):
            renewed = renew_leases(dict(self._waiting), self.peers.service, self.plan.fingerprint, self.keys)
            for request_id, sent in renewed.items():
                if request_id in self._waiting:
                    self._renewed[request_id] = sent

    def rank_stats(self) -> list[dict[str, Any]]:
        return [h.call({"op": "stats"}, timeout=10) for h in self.ranks]
