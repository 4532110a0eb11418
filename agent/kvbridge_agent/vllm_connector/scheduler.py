"""The connector's scheduler half: which requests to read or offer, the leases, and the side-channel listener.

It runs in vLLM's engine-core process and touches no KV memory. Prefill: a finished request with
``do_remote_decode`` keeps its blocks (vLLM's delayed free) until the worker reports every reader done or its
lease ends; the lease starts when the parameters are published and travels in them (``expiresAt``). A verified
request is digested right after the step that completes its prompt, and its digests are added to the parameters
before vLLM sends the answer (``take_digests``), so decode checks them in the step its READs complete. Decode: a
request with kvbridge parameters is loaded asynchronously; its whole prompt comes from prefill less what the
local prefix cache already holds (with sliding windows, less its last token too: window_backoff.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from pydantic import ValidationError

from kvbridge_agent.core import KVBridgeError, Role, Verification, build_plan, wire_block_ids
from kvbridge_agent.core.admission import Admission, PrefillHosts, TransferRefusedError
from kvbridge_agent.core.digest import RequestDigests, VerificationPolicy, from_bytes, new_key
from kvbridge_agent.core.handshake import (
    INVALID_REQUEST_ID,
    DigestState,
    KVTransferParams,
    RankMetadata,
    TransferDigests,
    request_id_problem,
)
from kvbridge_agent.core.plan import PeerTensorParallel
from kvbridge_agent.core.signing import (
    TransferNotSignedError,
    check_signature,
    decode_pods,
    load_token,
    request_prompt_hash,
)
from kvbridge_agent.core.tracing import context_of
from kvbridge_agent.transfer.keys import load_keys
from kvbridge_agent.transfer.peers import LEASE_CLOCK_MARGIN_SECONDS, PrefillService, renew_leases
from kvbridge_agent.transfer.side_channel import SideChannelServer, heartbeat_interval

from .digest_relay import DigestReceiver, start_relay
from .messages import (
    PARAMS_KEY,
    DigestOrder,
    InvalidTransferParamsError,
    OfferOrder,
    RankHandshake,
    ReadOrder,
    StepMetadata,
    by_group,
    refusal,
    transfer_params,
)
from .settings import ConnectorSettings
from .stage_relay import StageRelay, stage_relay
from .stats import DIGESTS
from .window_backoff import WindowBackoff

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler

#: how long prefill keeps serving a request's digests after its readers are done (they ask right after reading)
RETIRED_DIGEST_SECONDS = 60.0
#: vLLM's request states in which a prefill's KV is complete (anything else frees the blocks at once)
_FINISHED_NORMALLY = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class ConnectorScheduler:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.engine_id = settings.environment.engine_id
        self._lock = threading.Lock()  # heartbeats arrive on the side-channel thread
        self._leases: dict[str, float] = {}  # prefill: held request -> lease end (Unix time)
        self._to_read: dict[str, ReadOrder] = {}
        self._to_offer: dict[str, OfferOrder] = {}
        self._server: SideChannelServer | None = None
        self._relay: DigestReceiver | None = None  # prefill: the ranks' digests as they are taken
        self._stages: StageRelay | None = None  # prefill with staging buffers: stage requests to the ranks
        self._incarnation = ""
        # prefill, verification: requests offered to be digested, and their keys and the digests the ranks
        # reported (by head)
        self._verification = VerificationPolicy(settings.transfer)
        self._verifying: set[str] = set()
        self._digests: dict[str, RequestDigests] = {}
        #: prefill: requests to offer once computed (do_remote_decode), their blocks as vLLM allocates them (per
        #: cache group)
        self._producing: dict[str, tuple[Any, list[list[int]]]] = {}
        #: prefill: verified requests digested right after the step that completed their prompt: their key and
        #: token count, until they finish
        self._predigested: dict[str, tuple[bytes, int]] = {}
        self._to_digest: dict[str, DigestOrder] = {}
        #: prefill: the transfer parameters (kvbridge's part) of requests that finished in the step being processed,
        #: waiting for that step's digests (they are added before vLLM sends the answer)
        self._awaiting_digests: dict[str, dict[str, Any]] = {}
        #: digests of requests whose readers are done, kept a while: a reader asks for them after its READs
        #: completed, which is also when prefill learns it is done
        self._retired: deque[tuple[float, str]] = deque()
        self._heads = 1 if settings.model.is_mla else settings.model.num_kv_heads
        self._tp_size = settings.tp_size
        environment = settings.environment
        # prefill offers wire blocks: with a prefill-side split, block b becomes wire blocks b*r .. b*r + r-1
        self._plan = build_plan(environment.model, environment.prefill, environment.decode, environment.transfer)
        #: decode: its deployment's bounds on transfer parameters: prefill TPs, the model's length, prefill hosts
        peer_tp = PeerTensorParallel(environment.model, environment.prefill, environment.decode, environment.transfer)
        hosts = PrefillHosts(environment.prefill_hosts or ())
        self._admission = Admission(peer_tp, settings.max_model_len, self._plan.wire.block_size, hosts)
        self._keys = load_keys(environment.keys_dir) if environment.keys_dir else None
        #: decode: the router's token (spec.router.signTransfers): parameters without its signature are refused
        self._transfer_token = (
            load_token(environment.transfer_token_file)
            if environment.transfer_token_file and settings.role is Role.DECODE
            else None
        )
        #: decode: the pod names a router's signature may name for this engine
        self._pods = decode_pods(environment.engine_id, environment.dp_index, environment.own.data_parallel_size)
        # decode: requests whose KV is still to be read, by request id; a thread renews their leases on prefill
        self._waiting: dict[str, KVTransferParams] = {}
        #: decode: requests whose kvbridge parameters did not validate, and why (until their blocks are allocated)
        self._refused: dict[str, str] = {}
        self._renewed: dict[str, float] = {}  # decode request -> when a heartbeat last renewed its prefill lease
        self._backoff = WindowBackoff(settings)  # sliding windows: prefill leaves the prompt's last token to decode
        self._service = PrefillService(environment.prefill_service, settings.transfer.handshake_timeout_seconds)
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        if settings.role is Role.DECODE:
            self._heartbeat_thread = threading.Thread(target=self._heartbeats, name="kvbridge-heartbeat", daemon=True)
            self._heartbeat_thread.start()

    # -- prefill: serving the ranks' metadata ----------------------------------
    def set_xfer_handshake_metadata(self, ranks: dict[int, RankHandshake]) -> None:
        if self.settings.role is not Role.PREFILL or self._server is not None:
            return
        served = {
            r: (RankMetadata.model_validate_json(h.rank_metadata_json), h.agent_metadata) for r, h in ranks.items()
        }
        incarnations = {meta.incarnation for meta, _ in served.values()}
        if len(incarnations) != 1:
            raise RuntimeError(f"kvbridge: TP ranks report different incarnations {sorted(incarnations)}")
        self._incarnation = incarnations.pop()
        environment = self.settings.environment
        keys = self._keys
        self._stages = stage_relay(self._incarnation, served, self.settings.transfer.handshake_timeout_seconds)
        self._server = SideChannelServer(
            environment.side_channel_host,
            environment.side_channel_port,
            self.settings.fingerprint,
            served,
            keys,
            on_heartbeat=self._renew,
            digests=self._published_digests,
            on_stage=self._stages,
        ).start()
        if self.settings.transfer.verification is not Verification.OFF:
            self._relay = start_relay(self._incarnation, self._relayed)
        log.info(
            "kvbridge: side channel of %s on %s:%d (%s)",
            self.engine_id,
            environment.side_channel_host,
            self._server.port,
            "CURVE" if keys else "no CURVE",
        )

    def _published_digests(self, request_id: str) -> tuple[DigestState, RequestDigests | None]:
        """The side channel's answer to a decode asking for a request's digests (on the listener's thread)."""
        with self._lock:
            found = self._digests.get(request_id)
            if found is not None and len(found.heads) == self._heads:
                return DigestState.READY, RequestDigests(found.key, dict(found.heads))
            return (DigestState.PENDING if request_id in self._verifying else DigestState.UNKNOWN), None

    def _relayed(self, request_id: str, heads: list[int], raw: bytes) -> None:
        """A rank's digests of a request the moment it took them (digest_relay.py, the relay's thread)."""
        if any(not 0 <= head < self._heads for head in heads):
            raise ValueError(f"heads {heads[:8]} outside the model's {self._heads}")
        digests = from_bytes(heads, raw)
        with self._lock:
            found = self._digests.get(request_id)
            if found is not None and request_id in self._verifying:
                found.heads.update(digests)

    def take_digests(self, stats: Any) -> None:
        """The digests the prefill ranks computed this step (they ride in the worker's stats): kept for the side
        channel, added to the transfer parameters of requests that finished in this step, and taken out, so that
        they never travel on to the metrics."""
        data = getattr(stats, "data", None)
        if isinstance(data, dict) and data.get(DIGESTS):
            with self._lock:
                for request_id, heads, raw in data.pop(DIGESTS):
                    found = self._digests.get(request_id)
                    if found is not None:  # else no longer kept (retired)
                        found.heads.update(from_bytes(heads, raw))
            data[DIGESTS] = []
        # vLLM hands update_connector_output this step's worker output after request_finished built the answers of
        # the requests that finished in it, and before it sends them: the dict the answer holds is completed here
        with self._lock:
            for request_id, ours in self._awaiting_digests.items():
                found = self._digests.get(request_id)
                if found is not None and len(found.heads) == self._heads:
                    ours["digests"] = TransferDigests.of(found).model_dump(mode="json", by_alias=True)
            self._awaiting_digests.clear()

    def _renew(self, request_ids: list[str]) -> list[str]:
        """Renew the leases still running by more than the clock margin (the worker frees an expired request from
        its copy of the leases, up to a step old: a lease about to end is not renewed, and not said to be)."""
        now = time.time()
        until = now + self.settings.transfer.lease_seconds
        renewed = []
        with self._lock:
            for request_id in request_ids:
                if self._leases.get(request_id, now) - now > LEASE_CLOCK_MARGIN_SECONDS:
                    self._leases[request_id] = max(self._leases[request_id], until)
                    renewed.append(request_id)
        return renewed

    def on_new_request(self, request: Any) -> None:
        self._backoff.truncate(request)  # prefill: a prompt at a sliding window's edge leaves its last token to decode

    # -- decode: what to load ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.settings.role is not Role.DECODE:
            return 0, False
        raw = request.kv_transfer_params
        if not isinstance(raw, dict) or not raw.get("do_remote_prefill"):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        try:
            if self._transfer_token is not None:
                prompt = request_prompt_hash(request)  # the signature binds prefill's hash of the same prompt
                check_signature(self._transfer_token, raw, pods=self._pods, prompt=prompt, params_key=PARAMS_KEY)
            params = transfer_params(raw)
            if params is not None:
                self._admission.check(params, f"kv_transfer_params.{PARAMS_KEY}")
        except (InvalidTransferParamsError, TransferNotSignedError, TransferRefusedError) as exc:
            # the request fails when its load is reported, never by a raise
            why = str(exc) if isinstance(exc, InvalidTransferParamsError) else f"{exc.field}: {exc.message}"
            self._refused[request.request_id] = f"{exc.code}: {why}"
            log.warning("kvbridge: request %.80s: %s", request.request_id, exc)
            return (count, True) if count > 0 else (0, False)
        if params is None:
            return 0, False
        count = self._backoff.remote_tokens(count + num_computed_tokens, params.num_tokens) - num_computed_tokens
        if count > 0:  # else all prefill offered is in the local prefix cache: nothing to read (its lease frees it)
            with self._lock:
                self._waiting[request.request_id] = params  # renew prefill's lease while the request waits here
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        raw = request.kv_transfer_params
        if self.settings.role is Role.PREFILL and isinstance(raw, dict) and raw.get("do_remote_decode"):
            self._producing[request.request_id] = (request, [])  # its blocks come with the steps that compute it
            return
        if self.settings.role is not Role.DECODE or not isinstance(raw, dict) or not raw.get("do_remote_prefill"):
            return
        raw["do_remote_prefill"] = False  # one transfer per request, also after a preemption
        if num_external_tokens <= 0:  # nothing to read: vLLM waits for no load (a report would be fatal to it)
            return
        groups = self.settings.groups
        every = by_group(blocks.get_block_ids())
        unhashed: list[list[int]] = [[] for _ in every]  # per group; vLLM leaves out null blocks
        if num_external_tokens > 0:
            unhashed = (
                [list(blocks.get_unhashed_block_ids())]
                if groups is None
                else [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
            )
        local = [b for group in unhashed for b in group]
        refused = self._refused.pop(request.request_id, "")
        if refused:  # parameters that did not validate: the request's blocks are reported invalid, nothing read
            self._to_read[request.request_id] = ReadOrder(local, None, refused)
            return
        try:
            params = transfer_params(raw)
        except InvalidTransferParamsError:  # refused by get_num_new_matched_tokens (a full prefix hit loads nothing)
            return
        if params is None:
            return
        with self._lock:
            renewed = self._renewed.pop(request.request_id, None)
        expires_at = params.expires_at
        if expires_at is not None and renewed is not None:  # prefill renews from when the heartbeat arrives
            expires_at = max(expires_at, renewed + self.settings.transfer.lease_seconds)
        refused = self._backoff.mismatch(len(request.prompt_token_ids or ()), params.num_tokens)
        local_sizes: list[int] | None = None
        digest_tokens = params.num_tokens
        block_layers: list[int] | None = None
        if groups is None:
            all_blocks = every[0]
        else:
            try:
                kept = groups.clip(every, params.num_tokens)
            except KVBridgeError as exc:
                kept, refused = [[] for _ in every], refused or f"{exc.code}: {exc.message}"
            mine = [set(group) for group in kept]  # per group, the unhashed blocks among those the group keeps
            to_fill = [[b for b in group if b in keep] for group, keep in zip(unhashed, mine, strict=False)]
            # a refused order fails every block vLLM counts as loading (it recomputes them), not only the kept ones
            local = [b for group in (unhashed if refused else to_fill) for b in group]
            local_sizes = None if refused else [len(group) for group in to_fill]
            all_blocks = [b for group in kept for b in group]
            digest_tokens = groups.digest_tokens(all_blocks)
            block_layers = groups.block_layers([len(group) for group in kept])
        trace = context_of(getattr(request, "trace_headers", None))
        self._to_read[request.request_id] = ReadOrder(
            local, params, refused, expires_at, all_blocks, local_sizes, digest_tokens, trace, block_layers
        )

    # -- both: each step ------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any = None) -> StepMetadata:
        if scheduler_output is not None and self._producing:
            self._order_digests(scheduler_output)
        with self._lock:
            meta = StepMetadata(
                to_read=self._to_read, to_offer=self._to_offer, to_digest=self._to_digest, leases=dict(self._leases)
            )
        self._to_read, self._to_offer, self._to_digest = {}, {}, {}
        return meta

    def _order_digests(self, scheduler_output: Any) -> None:
        """Prefill: follow the blocks of the requests it will offer, and have the ranks digest each verified one
        right after the step that completes its prompt (the decision to verify is taken here, once)."""
        for new in scheduler_output.scheduled_new_reqs:
            producing = self._producing.get(new.req_id)
            if producing is not None:
                producing[1][:] = [list(group) for group in new.block_ids or ()]
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for request_id, added in zip(cached.req_ids, cached.new_block_ids, strict=False):
            producing = self._producing.get(request_id)
            if producing is not None and added:
                if request_id in resumed or len(producing[1]) != len(added):  # its whole block table anew
                    producing[1][:] = [[] for _ in added]
                for group, ids in zip(producing[1], added, strict=True):
                    group.extend(ids)
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            producing = self._producing.get(request_id)
            if producing is None or request_id in self._predigested:
                continue
            request, blocks = producing
            prompt = int(request.num_prompt_tokens)
            if request.num_computed_tokens + scheduled < prompt or not self._verification.decide():
                continue
            groups = self.settings.groups
            if groups is None:
                order = DigestOrder(list(blocks[0]) if blocks else [], prompt, new_key())
            else:
                try:
                    flat, flat_sizes = groups.flatten(blocks, prompt)
                except KVBridgeError as exc:  # digested at the offer instead, or not offered (request_finished)
                    log.warning("kvbridge: not digesting request %.80s now: %s", request_id, exc.message)
                    continue
                order = DigestOrder(
                    flat, groups.digest_tokens(flat), new_key(), block_layers=groups.block_layers(flat_sizes)
                )
            order.trace = context_of(getattr(request, "trace_headers", None))
            key = order.key
            self._predigested[request_id] = (key, prompt)
            self._to_digest[request_id] = order
            with self._lock:
                self._verifying.add(request_id)
                self._digests[request_id] = RequestDigests(key, {})

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of the step: the digests they computed, then the transfers they finished."""
        self.take_digests(connector_output.kv_connector_stats)
        self.transfers_done(connector_output.finished_sending, connector_output.finished_recving)

    def transfers_done(self, finished_sending: set[str] | None, finished_recving: set[str] | None) -> None:
        with self._lock:
            now = time.monotonic()
            for request_id in finished_sending or ():
                self._leases.pop(request_id, None)
                if request_id in self._verifying:
                    self._verifying.discard(request_id)
                    self._retired.append((now + RETIRED_DIGEST_SECONDS, request_id))
            while self._retired and self._retired[0][0] < now:
                self._digests.pop(self._retired.popleft()[1], None)
            for request_id in finished_recving or ():
                self._waiting.pop(request_id, None)
                self._renewed.pop(request_id, None)

    def _heartbeats(self) -> None:
        """Decode: renew the prefill leases of requests that still wait for their KV (a loaded decode may queue
        a request for longer than the lease)."""
        while not self._stop.wait(heartbeat_interval(self.settings.transfer.lease_seconds)):
            with self._lock:
                waiting = dict(self._waiting)
            renewed = renew_leases(waiting, self._service, self.settings.fingerprint, self._keys)  # DNS here
            with self._lock:
                self._renewed.update((r, sent) for r, sent in renewed.items() if r in self._waiting)

    # -- prefill: publishing a finished request ------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: offer a finished request to decode, or free its blocks now. Never raises (vLLM treats an
        exception here as the engine's death): a request that cannot be offered says why in its answer."""
        request_id = request.request_id
        predigested = self._forget(request_id)
        raw = request.kv_transfer_params
        if self.settings.role is not Role.PREFILL or not isinstance(raw, dict) or not raw.get("do_remote_decode"):
            return False, None
        per_group = by_group(block_ids)
        server = self._server
        if request.status.name not in _FINISHED_NORMALLY or not per_group[0] or server is None:
            if predigested is not None:
                with self._lock:
                    self._verifying.discard(request_id)
                    self._digests.pop(request_id, None)
            return False, None
        # everything a request carries is checked before anything is recorded for it
        problem = request_id_problem(request_id)
        if problem:
            log.warning("kvbridge: not offering request %.80s: %s", request_id, problem)
            return False, refusal(INVALID_REQUEST_ID, problem)
        return self._offer(request, per_group, predigested, server)

    def _forget(self, request_id: str) -> tuple[bytes, int] | None:
        """Drop what was followed of a finished request; its key and prompt tokens if it was digested already."""
        predigested = self._predigested.pop(request_id, None)
        self._producing.pop(request_id, None)
        self._backoff.forget(request_id)
        with self._lock:
            self._waiting.pop(request_id, None)
            self._renewed.pop(request_id, None)
            self._refused.pop(request_id, None)
        return predigested

    def _offer(
        self, request: Any, per_group: list[list[int]], predigested: tuple[bytes, int] | None, server: SideChannelServer
    ) -> tuple[bool, dict[str, Any]]:
        """Publish a request's transfer parameters and hold its blocks under a lease (request_finished's checks
        passed); blocks that cannot hold its tokens are not offered, and the answer says why."""
        request_id, blocks = request.request_id, per_group[0]
        expires_at = time.time() + self.settings.transfer.lease_seconds
        # a secret draw (the client's request id does not enter it), taken when the prompt's last step was
        # scheduled if this engine saw it (then the ranks digested it right after that step's forward)
        verify = predigested is not None or self._verification.decide()
        key = predigested[0] if predigested is not None else new_key() if verify else b""
        num_tokens = request.num_computed_tokens
        groups, sizes = self.settings.groups, None
        try:
            if groups is None:
                wire = wire_block_ids(blocks, num_tokens, self._plan.split_ratio, self._plan.wire.block_size).tolist()
            else:  # a hybrid model: each group's blocks it keeps, one group after the other
                wire, sizes = groups.flatten(per_group, num_tokens)
            params = KVTransferParams(
                remote_engine_id=self.engine_id,
                remote_incarnation=self._incarnation,
                remote_host=self.settings.environment.side_channel_host,
                remote_port=server.port,
                remote_request_id=request_id,
                num_tokens=num_tokens,
                remote_block_ids=wire,
                remote_group_sizes=sizes,
                remote_tp_size=self._tp_size,
                fingerprint=self.settings.fingerprint,
                expires_at=expires_at,
                verify=verify,
                lease_token=server.token(request_id),
                prompt_hash=self._backoff.prompt_hash(request),  # what a signing router binds (core/signing.py)
            )
        except (KVBridgeError, ValidationError) as exc:  # blocks that cannot hold the tokens: not offered
            code, message = (
                (exc.code, exc.message)
                if isinstance(exc, KVBridgeError)
                else (InvalidTransferParamsError.code, str(exc.errors()[0]["msg"]))
            )
            log.error("kvbridge: not offering request %.80s: %s", request_id, message)
            return False, refusal(code, message)
        ours = params.model_dump(mode="json", by_alias=True, exclude_none=True)
        digested = predigested is not None and predigested[1] == num_tokens  # else digested again at the offer
        with self._lock:
            self._leases[request_id] = expires_at
            if verify:
                self._verifying.add(request_id)
                if not digested:
                    self._digests[request_id] = RequestDigests(key, {})
                else:  # this step's digests complete the answer before vLLM sends it (take_digests)
                    self._awaiting_digests[request_id] = ours
        digest_tokens = (num_tokens if groups is None else groups.digest_tokens(wire)) if verify and not digested else 0
        layers = None if groups is None or sizes is None else groups.block_layers(sizes)
        trace = context_of(getattr(request, "trace_headers", None))
        offered = blocks if groups is None else wire
        self._to_offer[request_id] = OfferOrder(offered, expires_at, digest_tokens, key, trace, layers)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: ours}

    def shutdown(self) -> None:
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        if self._stages is not None:  # after the side channel: nothing relays any more
            self._stages.close()
