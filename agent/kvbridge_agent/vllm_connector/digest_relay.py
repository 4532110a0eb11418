"""Prefill's digests from each worker rank to the scheduler's side channel the moment they are taken.

A local socket inside the pod (ZMQ PUSH → PULL over ``ipc://``, in a folder only the engine's user may enter):
a decode asking for a request's digests is answered as soon as every rank has taken them, not one engine step
later, when they also arrive with the step's output (the way they take where this socket is missing — a rank whose
send would block drops it). Every frame is parsed with bounds before anything is kept; a bad one is dropped and
logged, and nothing a frame holds can add a request: only the digests of requests the scheduler is verifying are
kept (``deliver`` decides).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from kvbridge_agent.transfer.background import background_thread

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler

PROTOCOL = b"kvbridge-digest-relay/1"
#: bounds on a frame: a request id's bytes, the heads of one rank, the rows' bytes (heads x wire blocks x 8)
MAX_REQUEST_ID_BYTES = 1024
MAX_HEADS = 4096
MAX_DATA_BYTES = 64 << 20
#: the frames a sender queues before it drops (the scheduler has stopped reading)
SEND_QUEUE = 1024
POLL_MILLISECONDS = 100

#: what the scheduler does with a rank's digests of one request: (request id, heads, rows as little-endian uint64)
Deliver = Callable[[str, list[int], bytes], None]


def private_folder() -> Path:
    """The folder of this user's local sockets, mode 0700 (refused when anyone else may enter it)."""
    folder = Path(tempfile.gettempdir()) / f"kvbridge-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    found = folder.stat()
    if found.st_uid != os.getuid() or stat.S_IMODE(found.st_mode) & 0o077:
        raise PermissionError(f"{folder} is not this user's alone (mode {stat.S_IMODE(found.st_mode):o})")
    return folder


def relay_address(incarnation: str) -> str:
    """Where one engine start's relay listens: a folder of this user's, mode 0700, and the engine's incarnation."""
    return f"ipc://{private_folder()}/digests-{incarnation}"


def parse(frames: list[bytes]) -> tuple[str, list[int], bytes]:
    """A relay frame's request id, heads and rows; ValueError naming what is wrong."""
    if len(frames) != 4 or frames[0] != PROTOCOL:
        raise ValueError(f"not a {PROTOCOL.decode()} frame ({len(frames)} parts)")
    _, raw_id, raw_heads, data = frames
    if not 0 < len(raw_id) <= MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id of {len(raw_id)} bytes (1..{MAX_REQUEST_ID_BYTES})")
    if len(raw_heads) % 2 or not 0 < len(raw_heads) // 2 <= MAX_HEADS:
        raise ValueError(f"heads of {len(raw_heads)} bytes (1..{MAX_HEADS} uint16)")
    heads = np.frombuffer(raw_heads, dtype="<u2").tolist()
    if len(data) > MAX_DATA_BYTES or len(data) % (8 * len(heads)):
        raise ValueError(f"{len(data)} bytes of rows for {len(heads)} heads")
    return raw_id.decode("utf-8"), heads, data


class DigestSender:
    """A worker rank's end: each digest as it is taken (called from the digest thread only)."""

    def __init__(self, incarnation: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(relay_address(incarnation))

    def send(self, request_id: str, heads: list[int], data: bytes) -> None:
        frames = [PROTOCOL, request_id.encode(), np.asarray(heads, dtype="<u2").tobytes(), data]
        with contextlib.suppress(zmq.ZMQError):  # nobody reads (yet): the step's output carries them
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class DigestReceiver:
    """The scheduler's end: frames read on a thread of its own, each handed to ``deliver``."""

    def __init__(self, incarnation: str, deliver: Deliver) -> None:
        self._deliver = deliver
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES + MAX_REQUEST_ID_BYTES + 2 * MAX_HEADS + 64)
        self.address = relay_address(incarnation)
        self._socket.bind(self.address)
        self._stop = threading.Event()
        self._thread = background_thread(self._run, "kvbridge-digest-relay", "kvbridge-relay")
        self._thread.start()

    def _run(self) -> None:
        while (frames := next_frames(self._socket, self._stop)) is not None:
            try:
                self._deliver(*parse(frames))
            except Exception as exc:  # a bad frame is dropped; the relay keeps reading
                log.warning("kvbridge: dropped a digest relay frame: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        close_listener(self._context, self._socket, self.address)


def next_frames(socket: zmq.Socket[bytes], stop: threading.Event) -> list[bytes] | None:
    """A listener thread's next message, polled every :data:`POLL_MILLISECONDS` (a failed receive is skipped);
    ``None`` once ``stop`` is set."""
    while not stop.is_set():
        try:
            if socket.poll(POLL_MILLISECONDS):
                return socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            continue
    return None


def close_listener(context: zmq.Context[zmq.Socket[bytes]], socket: zmq.Socket[bytes], address: str) -> None:
    """Close a listener bound at ``ipc://`` ``address`` (its thread stopped) and remove its socket file."""
    socket.close(linger=0)
    context.term()
    with contextlib.suppress(OSError):
        os.unlink(address.removeprefix("ipc://"))


def start_relay(incarnation: str, deliver: Deliver) -> DigestReceiver | None:
    """The scheduler's end of the relay, or ``None`` (logged) where it cannot listen: the digests then reach the
    scheduler with the steps' output only."""
    try:
        return DigestReceiver(incarnation, deliver)
    except (OSError, zmq.ZMQError) as exc:
        log.warning("kvbridge: no digest relay (%s): digests go with the steps' output only", exc)
        return None
