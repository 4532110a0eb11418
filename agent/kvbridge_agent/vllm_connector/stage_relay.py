"""Prefill's stage requests (docs/protocol.md §4d) from the scheduler's side channel to the worker rank they name.

vLLM's scheduler and its TP workers may be different processes (its multiprocess executor): the side channel, in
the scheduler, hands a stage request (its lease token already checked) to :class:`StageRelay`, which asks the rank's
:class:`StageServer` over a local socket inside the pod (ZMQ REQ → ROUTER over ``ipc://``, in the folder only the
engine's user may enter, as ``digest_relay``) and waits at most its timeout; the server's thread has the rank pack
(``PrefillRank.stage``, which takes the rank's lock against vLLM's thread offering and freeing on it) and answers.

One schema for every frame, parsed with bounds before anything is used (:func:`parse_request`,
:func:`parse_reply`)::

    request  [PROTOCOL, request id (1..1024 bytes, UTF-8), StageRequest JSON (..64 KiB)]
    reply    [PROTOCOL, b"ok", StageReply JSON (..4 KiB)]
           | [PROTOCOL, b"error", code ([A-Z][A-Z0-9_]*, ..64 bytes), message (UTF-8, ..4 KiB)]

A garbled frame is answered with ``MALFORMED_MESSAGE`` (or dropped where it has no envelope to answer by), a rank's
refusal keeps its code, and a rank that is gone or does not answer in time is :data:`STAGE_RANK_UNAVAILABLE`:
never a raise that is not a typed :class:`KVBridgeError`, never a wait without a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable

import zmq
from pydantic import ValidationError

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.errors import INTERNAL_ERROR
from kvbridge_agent.core.handshake import MALFORMED_MESSAGE
from kvbridge_agent.core.stage_requests import STAGE_PLAN_INVALID, StageReply, StageRequest
from kvbridge_agent.transfer.background import background_thread
from kvbridge_agent.transfer.staging import staging_bytes

from .digest_relay import close_listener, next_frames, private_folder

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler

PROTOCOL = b"kvbridge-stage-relay/1"
MAX_REQUEST_ID_BYTES = 1024
MAX_REQUEST_BYTES = 64 << 10
MAX_REPLY_BYTES = 4 << 10
MAX_CODE_BYTES = 64
MAX_MESSAGE_BYTES = 4 << 10
#: how long the side channel waits for a rank to pack (less than decode's wait, staging.STAGE_WAIT_SECONDS, so that
#: decode hears why; the side channel answers nothing else meanwhile)
RELAY_SECONDS = 0.75
#: the worker rank a stage request names is gone, or did not answer within the relay's timeout
STAGE_RANK_UNAVAILABLE = "STAGE_RANK_UNAVAILABLE"
_CODE = re.compile(r"[A-Z][A-Z0-9_]*")

#: what a worker rank does with a stage request: ``PrefillRank.stage`` (a typed KVBridgeError refuses)
Stage = Callable[[str, StageRequest], StageReply]


def stage_address(incarnation: str, rank: int) -> str:
    """Where one TP rank of one engine start serves stage requests."""
    return f"ipc://{private_folder()}/stage-{incarnation}-{rank}"


def _malformed(why: str) -> KVBridgeError:
    return KVBridgeError(f"stage relay frame: {why}", field="stageRelay", code=MALFORMED_MESSAGE)


def parse_request(frames: list[bytes]) -> tuple[str, StageRequest]:
    """A relayed stage request's prefill request id and request; ``MALFORMED_MESSAGE`` naming what is wrong."""
    if len(frames) != 3 or frames[0] != PROTOCOL:
        raise _malformed(f"not a {PROTOCOL.decode()} request ({len(frames)} parts)")
    _, raw_id, body = frames
    if not 0 < len(raw_id) <= MAX_REQUEST_ID_BYTES or len(body) > MAX_REQUEST_BYTES:
        raise _malformed(f"a request id of {len(raw_id)} bytes, a body of {len(body)}")
    try:
        return raw_id.decode("utf-8"), StageRequest.model_validate_json(body)
    except UnicodeDecodeError as exc:
        raise _malformed("a request id that is not UTF-8") from exc
    except ValidationError as exc:
        raise _malformed(f"the stage request: {exc.errors()[0]['msg']}") from exc
    except KVBridgeError as exc:  # a decode layout whose strides contradict its order
        raise _malformed(f"the stage request: {exc.message}") from exc


def encode_request(request_id: str, request: StageRequest) -> list[bytes]:
    return [PROTOCOL, request_id.encode(), request.model_dump_json().encode()]


def encode_reply(reply: StageReply) -> list[bytes]:
    return [PROTOCOL, b"ok", reply.model_dump_json().encode()]


def encode_error(code: str, message: str) -> list[bytes]:
    code = code if _CODE.fullmatch(code) and len(code) <= MAX_CODE_BYTES else INTERNAL_ERROR
    return [PROTOCOL, b"error", code.encode(), message.encode()[:MAX_MESSAGE_BYTES]]


def parse_reply(frames: list[bytes]) -> StageReply:
    """A rank's answer: its reply, or its refusal raised as a :class:`KVBridgeError` with the rank's code (a frame
    out of bounds: ``MALFORMED_MESSAGE``)."""
    if len(frames) < 3 or frames[0] != PROTOCOL:
        raise _malformed(f"not a {PROTOCOL.decode()} reply ({len(frames)} parts)")
    if frames[1] == b"ok" and len(frames) == 3 and len(frames[2]) <= MAX_REPLY_BYTES:
        try:
            return StageReply.model_validate_json(frames[2])
        except ValidationError as exc:
            raise _malformed(f"the stage reply: {exc.errors()[0]['msg']}") from exc
    if frames[1] == b"error" and len(frames) == 4 and len(frames[3]) <= MAX_MESSAGE_BYTES:
        code = frames[2].decode("ascii", errors="replace")
        if len(frames[2]) <= MAX_CODE_BYTES and _CODE.fullmatch(code):
            raise KVBridgeError(frames[3].decode("utf-8", errors="replace"), field="stage", code=code)
    raise _malformed(f"a reply of kind {frames[1][:16]!r} in {len(frames)} parts")


class StageServer:
    """A worker rank's end: binds at once (:func:`start_server`), then serves on a thread of its own."""

    def __init__(self, incarnation: str, rank: int) -> None:
        self.rank = rank
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + MAX_REQUEST_ID_BYTES + 256)
        self.address = stage_address(incarnation, rank)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError:
            self._socket.close(linger=0)
            self._context.term()
            raise
        self._stop = threading.Event()
        self._thread = background_thread(self._run, f"kvbridge-stage-relay-{rank}", f"kvbridge-srel{rank}")
        self._stage: Stage | None = None

    def start(self, stage: Stage) -> StageServer:
        self._stage = stage
        self._thread.start()
        return self

    def _run(self) -> None:
        while (frames := next_frames(self._socket, self._stop)) is not None:
            # ROUTER: [identity, b"" (from REQ), *message]; no delimiter: not a REQ of ours, dropped
            if len(frames) < 2 or frames[1] != b"":
                log.warning("kvbridge: dropped a stage relay frame without an envelope (%d parts)", len(frames))
                continue
            reply = self.answer(frames[2:])
            with contextlib.suppress(zmq.ZMQError):  # the scheduler gave up waiting: nobody to answer
                self._socket.send_multipart([frames[0], b"", *reply], flags=zmq.NOBLOCK)

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one relayed request (never raises)."""
        try:
            request_id, request = parse_request(frames)
            if request.rank != self.rank:
                raise KVBridgeError(
                    f"a stage request for rank {request.rank} reached rank {self.rank}",
                    field="stage.rank",
                    code=STAGE_PLAN_INVALID,
                )
            if self._stage is None:
                raise KVBridgeError("this rank serves no stage requests yet", code=STAGE_RANK_UNAVAILABLE)
            return encode_reply(self._stage(request_id, request))
        except KVBridgeError as exc:
            return encode_error(exc.code, exc.message)
        except Exception as exc:  # a bug answers typed; the server keeps serving
            log.exception("kvbridge: a stage request failed on rank %d", self.rank)
            return encode_error(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        close_listener(self._context, self._socket, self.address)


def start_server(incarnation: str, rank: int, stage: Stage) -> StageServer | None:
    """A worker rank's end, serving ``stage``, or ``None`` (logged) where it cannot listen."""
    try:
        return StageServer(incarnation, rank).start(stage)
    except (OSError, zmq.ZMQError) as exc:
        log.warning("kvbridge: rank %d serves no stage requests (%s): decode reads it directly", rank, exc)
        return None


class StageRelay:
    """The scheduler's end: ``on_stage`` of its side channel. A fresh REQ socket per request (no stuck REQ state,
    safe from any thread), each answered within ``timeout`` or :data:`STAGE_RANK_UNAVAILABLE`."""

    def __init__(self, incarnation: str, ranks: Iterable[int], timeout: float) -> None:
        self.ranks = frozenset(ranks)
        self.timeout = timeout
        self._addresses = {rank: stage_address(incarnation, rank) for rank in self.ranks}
        self._context = zmq.Context()

    def __call__(self, request_id: str, request: StageRequest) -> StageReply:
        address = self._addresses.get(request.rank)
        if address is None:
            raise KVBridgeError(
                f"this engine has ranks {sorted(self.ranks)}, not {request.rank}",
                field="stage.rank",
                code=STAGE_PLAN_INVALID,
            )
        return parse_reply(self._exchange(address, encode_request(request_id, request), request.rank))

    def _exchange(self, address: str, frames: list[bytes], rank: int) -> list[bytes]:
        deadline = time.monotonic() + self.timeout
        try:
            socket = self._context.socket(zmq.REQ)
        except zmq.ZMQError as exc:  # closed under us (shutdown)
            raise self._unavailable(rank, str(exc)) from exc
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES + MAX_MESSAGE_BYTES + 256)
            socket.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout * 1000)))
            socket.connect(address)
            socket.send_multipart(frames)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not socket.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                raise self._unavailable(rank, f"no answer within {self.timeout:g} s")
            return socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise self._unavailable(rank, str(exc)) from exc
        finally:
            socket.close(linger=0)

    @staticmethod
    def _unavailable(rank: int, why: str) -> KVBridgeError:
        return KVBridgeError(
            f"prefill rank {rank} did not pack: {why}", field="stage.rank", code=STAGE_RANK_UNAVAILABLE
        )

    def close(self) -> None:
        self._context.term()


def stage_relay(incarnation: str, ranks: Iterable[int], timeout: float) -> StageRelay | None:
    """Prefill's scheduler: the side channel's ``on_stage`` where the environment gives the ranks a staging buffer
    (``KVBRIDGE_STAGING_MIB``; ``None``: the side channel answers ``STAGING_OFF``)."""
    if staging_bytes(os.environ, 0) <= 0:
        return None
    return StageRelay(incarnation, ranks, min(timeout, RELAY_SECONDS))
