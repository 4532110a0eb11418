"""The side channel (docs/protocol.md §5): one ZeroMQ ROUTER per prefill engine, REQ clients on decode.

Authenticated and encrypted with CURVE when keys are configured: the server
admits only clients holding the deployment's key pair.  Every receive has a
timeout; a malformed request gets an error reply and the listener keeps
serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.digest import RequestDigests, from_bytes, to_bytes
from kvbridge_agent.core.handshake import (
    HANDSHAKE_TIMEOUT,
    MALFORMED_MESSAGE,
    MAX_HEADER_BYTES,
    UNKNOWN_RANK,
    DigestState,
    HandshakeError,
    KVTransferParams,
    MessageType,
    Named,
    RankMetadata,
    decode_ack,
    decode_digest_reply,
    decode_reply,
    decode_request,
    encode_ack,
    encode_digest_reply,
    encode_error,
    encode_reply,
    encode_request,
    lease_token,
    tcp_endpoint,
    token_matches,
)
from kvbridge_agent.core.stage_requests import (
    STAGE_NOT_OFFERED,
    STAGING_OFF,
    StageReply,
    StageRequest,
    decode_stage_reply,
    decode_stage_request,
    encode_stage_reply,
    encode_stage_request,
)
from kvbridge_agent.transfer.keys import CurveKeys

log = logging.getLogger(__name__)

#: the largest message the listener accepts: a request is one header frame (ZMQ drops a peer that sends more,
#: before anything is allocated for it)
MAX_REQUEST_BYTES = 4 * MAX_HEADER_BYTES
#: the largest frame a client accepts in a reply (the NIXL agent's metadata is the largest, tens of KiB for a
#: 128-region cache); ZMQ drops a listener that sends more before allocating it, and the exchange times out
MAX_REPLY_FRAME_BYTES = 8 << 20
INTERNAL_ERROR = "INTERNAL_ERROR"


class _OnlyOurKey:
    """ZAP credentials check: admit a client only if it proves it holds the deployment's key pair."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public  # pyzmq passes the client's public key Z85-encoded


@dataclass
class ServerStats:
    served: int = 0
    rejected: int = 0  # malformed, wrong fingerprint or version, unknown rank
    heartbeats: int = 0
    digests: int = 0
    #: heartbeats or digest requests naming a request without its lease token (not offered to the asker)
    not_offered: int = 0
    staged: int = 0  # stage requests answered ready or busy


@dataclass
class SideChannelServer:
    """Serves every TP rank's metadata of one engine; runs in its own thread."""

    host: str
    port: int
    fingerprint: str
    ranks: dict[int, tuple[RankMetadata, bytes]]
    keys: CurveKeys | None = None
    #: renews the leases of the named requests it holds; returns those it renewed
    on_heartbeat: Callable[[list[str]], list[str]] | None = None
    #: a request's key and digests as prefill published them (docs/protocol.md §8), or why there are none
    digests: Callable[[str], tuple[DigestState, RequestDigests | None]] | None = None
    #: packs a request for one read of a decode rank (docs/protocol.md §4d); raises a typed KVBridgeError to refuse
    on_stage: Callable[[str, StageRequest], StageReply] | None = None
    stats: ServerStats = field(default_factory=ServerStats)
    #: this listener's secret: the lease tokens of the requests its engine offers are derived from it
    secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)

    def __post_init__(self) -> None:
        self._context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if self.keys is not None:
            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback(domain="kvbridge", credentials_provider=_OnlyOurKey(self.keys.public))
            self._socket.curve_server = True
            self._socket.curve_publickey = self.keys.public
            self._socket.curve_secretkey = self.keys.secret
            self._socket.zap_domain = b"kvbridge"
        self._socket.setsockopt(zmq.IPV6, 1)  # a pod's IP may be IPv6 (and IPv4 still binds)
        if self.port == 0:
            self.port = self._socket.bind_to_random_port(tcp_endpoint(self.host))
        else:
            self._socket.bind(tcp_endpoint(self.host, self.port))
        self._stop = threading.Event()
        #: the socket's owner: the listener thread while it serves, else whoever closes (see close)
        self._owner = threading.Lock()
        self._serving = False
        self._thread_closes = False
        self._released = False
        #: why the listener stopped serving, if it did without being closed (the engine then reports unhealthy)
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"side-channel:{self.port}", daemon=True)

    def start(self) -> SideChannelServer:
        self._serving = True
        try:
            self._thread.start()
        except BaseException:  # no thread: close releases the socket itself
            self._serving = False
            raise
        return self

    @property
    def alive(self) -> bool:
        """Serving: started, not closed, and the listener thread has not died."""
        return self._thread.is_alive() and self.failure is None and not self._stop.is_set()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # recorded and reported through health, never swallowed
            self.failure = f"side-channel listener stopped: {type(exc).__name__}: {exc}"
            log.exception("side channel: listener stopped")
        finally:
            with self._owner:
                self._serving = False
                release = self._thread_closes
            if release:  # close() gave up waiting and left the socket to this thread
                self._release()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            try:
                reply = self._answer(frames)
            except Exception as exc:  # one bad frame never stops the listener
                self.stats.rejected += 1
                log.exception("side channel: unexpected error answering a request")
                reply = [frames[0], b"", *encode_error(self.fingerprint, INTERNAL_ERROR, type(exc).__name__)]
            with contextlib.suppress(zmq.ZMQError):  # the peer may be gone already
                self._socket.send_multipart(reply, zmq.NOBLOCK)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # ROUTER: [identity, (b"" from REQ), *message]
        identity, rest = frames[0], frames[1:]
        envelope = [identity]
        if rest and rest[0] == b"":
            envelope.append(b"")
            rest = rest[1:]
        try:
            kind, rank, named = decode_request(rest, self.fingerprint)
            request_ids = self._offered(named)
            if kind is MessageType.HEARTBEAT:
                self.stats.heartbeats += 1
                renewed = self.on_heartbeat(request_ids) if self.on_heartbeat is not None and request_ids else []
                return envelope + encode_ack(self.fingerprint, renewed)
            if kind is MessageType.STAGE:
                return envelope + self._stage(rest, named, request_ids)
            if kind is MessageType.DIGEST:
                if len(named) != 1:
                    raise HandshakeError("a digest request names one request", code=MALFORMED_MESSAGE)
                asked = request_ids[0] if request_ids else None
                state, found = self.digests(asked) if self.digests and asked else (DigestState.UNKNOWN, None)
                self.stats.digests += 1
                if state is not DigestState.READY or found is None:
                    state = DigestState.UNKNOWN if state is DigestState.READY else state
                    return envelope + encode_digest_reply(self.fingerprint, state, [], b"")
                heads, data = to_bytes(found.heads)
                return envelope + encode_digest_reply(self.fingerprint, state, heads, data, found.key)
            if rank not in self.ranks:
                raise HandshakeError(f"this engine has ranks {sorted(self.ranks)}, not {rank}", code=UNKNOWN_RANK)
            metadata, agent = self.ranks[rank]
            self.stats.served += 1
            return envelope + encode_reply(self.fingerprint, metadata, agent)
        except HandshakeError as exc:
            self.stats.rejected += 1
            log.warning("side channel: rejected a request: %s", exc)
            return envelope + encode_error(self.fingerprint, exc.code, exc.message)

    def _stage(self, frames: list[bytes], named: list[Named], offered: list[str]) -> list[bytes]:
        """A stage request: one request, named with its lease token, for the engine to pack (docs/protocol.md §4d)."""
        if len(named) != 1:
            raise HandshakeError("a stage request names one request", code=MALFORMED_MESSAGE)
        request = decode_stage_request(frames)
        if not offered:
            raise HandshakeError("the request is not one this engine offered to the asker", code=STAGE_NOT_OFFERED)
        if self.on_stage is None:
            raise HandshakeError("this engine stages nothing", code=STAGING_OFF)
        try:
            reply = self.on_stage(offered[0], request)
        except HandshakeError:
            raise
        except KVBridgeError as exc:  # typed refusals keep their code
            raise HandshakeError(exc.message, code=exc.code) from exc
        self.stats.staged += 1
        return encode_stage_reply(self.fingerprint, reply)

    def token(self, request_id: str) -> str:
        """The lease token of a request this engine offers (it goes in the request's transfer parameters)."""
        return lease_token(self.secret, request_id)

    def _offered(self, named: list[Named]) -> list[str]:
        """The request ids whose lease token is right: those the asker was handed the parameters of."""
        offered = [request_id for request_id, token in named if token_matches(self.secret, request_id, token)]
        if len(offered) != len(named):
            self.stats.not_offered += len(named) - len(offered)
            log.warning("side channel: %d request(s) named without their lease token", len(named) - len(offered))
        return offered

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, then close the socket and its context.

        The listener thread uses the socket while it serves, and a ZMQ socket is not thread-safe: closing it under
        the thread would corrupt memory. A thread still answering after ``timeout`` (a callback that does not
        return) closes both itself when it ends; that is logged, and nothing waits longer.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        with self._owner:
            if self._serving:
                self._thread_closes = True
                log.error(
                    "side channel: the listener on port %d did not stop within %g s; it closes its socket when it does",
                    self.port,
                    timeout,
                )
                return
        self._release()

    def _release(self) -> None:
        with self._owner:
            if self._released:
                return
            self._released = True
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()


#: the sockets one thread keeps open for digest exchanges, at most (the least recently used is closed first)
KEPT_SOCKETS = 64


class _KeptSockets(threading.local):
    """One thread's REQ sockets kept connected across digest exchanges, by endpoint and key: the CURVE handshake
    and the TCP connection are paid once per prefill engine and thread, not once per request. A socket whose
    exchange failed (no answer in time, a send that would block) is closed, never reused in its stuck state."""

    def __init__(self) -> None:
        self.sockets: OrderedDict[tuple[str, bytes], zmq.Socket[bytes]] = OrderedDict()

    def take(self, key: tuple[str, bytes]) -> zmq.Socket[bytes] | None:
        return self.sockets.pop(key, None)

    def keep(self, key: tuple[str, bytes], socket: zmq.Socket[bytes]) -> None:
        self.sockets[key] = socket
        while len(self.sockets) > KEPT_SOCKETS:
            self.sockets.popitem(last=False)[1].close(linger=0)


_KEPT = _KeptSockets()


class SideChannelClient:
    """Talks to one prefill engine's listener; a fresh REQ socket per exchange (no stuck REQ state), except for
    digest exchanges, which reuse a socket the thread kept connected (:class:`_KeptSockets`)."""

    def __init__(self, host: str, port: int, fingerprint: str, keys: CurveKeys | None, timeout: float) -> None:
        self.endpoint = tcp_endpoint(host, port)
        self.fingerprint = fingerprint
        self.keys = keys
        self.timeout = timeout
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()

    def _socket(self) -> zmq.Socket[bytes]:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IPV6, 1)  # prefill's pod IP may be IPv6
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_FRAME_BYTES)
        if self.keys is not None:
            socket.curve_serverkey = self.keys.public
            socket.curve_publickey = self.keys.public
            socket.curve_secretkey = self.keys.secret
        socket.connect(self.endpoint)
        return socket

    def _exchange(self, request: Sequence[bytes], deadline: float, kept: bool = False) -> list[bytes]:
        """One request and its reply, on a fresh socket, or (``kept``) on the one this thread keeps connected to
        this endpoint, kept again only after a whole exchange."""
        key = (self.endpoint, self.keys.secret if self.keys is not None else b"")
        socket = (_KEPT.take(key) if kept else None) or self._socket()
        done = False
        try:
            # a send on a REQ socket whose peer never completes the CURVE handshake may block: bound it too
            socket.setsockopt(zmq.SNDTIMEO, max(1, int((deadline - time.monotonic()) * 1000)))
            try:
                socket.send_multipart(list(request))
            except zmq.Again:
                remaining = 0.0
            else:
                remaining = deadline - time.monotonic()
            if remaining <= 0 or not socket.poll(int(remaining * 1000), zmq.POLLIN):
                raise HandshakeError(
                    f"no answer from {self.endpoint} within {self.timeout:g} s (wrong address, engine down, "
                    f"a side-channel key that does not match, or a reply frame over {MAX_REPLY_FRAME_BYTES} bytes)",
                    code=HANDSHAKE_TIMEOUT,
                )
            frames: list[bytes] = socket.recv_multipart()
            done = True
            return frames
        finally:
            if done and kept:
                _KEPT.keep(key, socket)
            else:
                socket.close(linger=0)

    def fetch(self, ranks: Sequence[int]) -> dict[int, tuple[RankMetadata, bytes]]:
        """Metadata of the given prefill ranks; all within one timeout."""
        deadline = time.monotonic() + self.timeout
        result: dict[int, tuple[RankMetadata, bytes]] = {}
        for rank in ranks:
            frames = self._exchange(encode_request(MessageType.METADATA, self.fingerprint, rank=rank), deadline)
            result[rank] = decode_reply(frames, self.fingerprint)
        return result

    def digests(self, request_id: str, token: str) -> tuple[DigestState, RequestDigests | None]:
        """The key and digests prefill published for one of its requests (by prefill's request id and its lease
        token); ``None`` unless ready."""
        frames = self._exchange(
            encode_request(MessageType.DIGEST, self.fingerprint, requests=[(request_id, token)]),
            time.monotonic() + self.timeout,
            kept=True,
        )
        state, heads, data, key = decode_digest_reply(frames, self.fingerprint)
        try:
            return state, RequestDigests(key, from_bytes(heads, data)) if state is DigestState.READY else None
        except ValueError as exc:
            raise HandshakeError(f"digest reply: {exc}", code=MALFORMED_MESSAGE) from exc

    def stage(self, request_id: str, token: str, request: StageRequest) -> StageReply:
        """Ask prefill to pack one of its requests (by its id and lease token) for one read (docs/protocol.md §4d);
        a refusal raises :class:`HandshakeError` with prefill's code."""
        frames = self._exchange(
            encode_stage_request(self.fingerprint, (request_id, token), request),
            time.monotonic() + self.timeout,
            kept=True,
        )
        return decode_stage_reply(frames, self.fingerprint)

    def heartbeat(self, requests: Sequence[Named]) -> set[str]:
        """Renew the leases of these requests (prefill's request id and lease token each); returns the ids prefill
        says it renewed (not those it no longer holds, nor those named with another listener's token)."""
        frames = self._exchange(
            encode_request(MessageType.HEARTBEAT, self.fingerprint, requests=requests),
            time.monotonic() + self.timeout,
        )
        renewed = decode_ack(frames, self.fingerprint)
        if renewed is None:  # a listener from before renewals were named: it renewed what it held, as it always did
            return {request_id for request_id, _ in requests}
        return set(renewed)


def heartbeat_interval(lease_seconds: float) -> float:
    """How often decode renews the leases of the requests it waits on: three times per lease."""
    return max(0.5, lease_seconds / 3)


def send_heartbeats(
    waiting: Mapping[str, KVTransferParams], fingerprint: str, keys: CurveKeys | None, timeout: float = 2.0
) -> dict[str, float]:
    """One round of heartbeats: on each prefill engine, renew the leases of the requests (decode's request id ->
    the prefill's parameters) decode still waits on. Returns, for each request prefill says it renewed, the time
    the heartbeat was sent (prefill renews from when it receives it: no earlier)."""
    by_engine: dict[tuple[str, int], list[tuple[str, KVTransferParams]]] = {}
    for request_id, params in waiting.items():
        by_engine.setdefault((params.remote_host, params.remote_port), []).append((request_id, params))
    renewed: dict[str, float] = {}
    for (host, port), waiting_there in by_engine.items():
        for pairs in _batches(waiting_there):  # each batch's header fits MAX_HEADER_BYTES
            sent = time.time()
            try:
                named = [(params.remote_request_id, params.lease_token) for _, params in pairs]
                held = SideChannelClient(host, port, fingerprint, keys, timeout).heartbeat(named)
            except HandshakeError as exc:
                log.warning("heartbeat to %s:%s failed: %s", host, port, exc)
                continue
            renewed.update((rid, sent) for rid, params in pairs if params.remote_request_id in held)
    return renewed


#: a heartbeat's header less what its request ids and tokens take: the envelope, the keys, the brackets
_HEARTBEAT_OVERHEAD = 256


def _batches(pairs: list[tuple[str, KVTransferParams]]) -> list[list[tuple[str, KVTransferParams]]]:
    """The requests waiting on one listener, in batches whose heartbeat header stays under MAX_HEADER_BYTES (each
    id and token as the JSON strings the header holds, and their separators)."""
    batches: list[list[tuple[str, KVTransferParams]]] = [[]]
    size = _HEARTBEAT_OVERHEAD
    for pair in pairs:
        params = pair[1]
        cost = len(json.dumps(params.remote_request_id)) + len(json.dumps(params.lease_token)) + 4
        if batches[-1] and size + cost > MAX_HEADER_BYTES:
            batches.append([])
            size = _HEARTBEAT_OVERHEAD
        batches[-1].append(pair)
        size += cost
    return [batch for batch in batches if batch]
