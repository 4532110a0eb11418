"""Whether a decode pod's answer holds an answer yet, or an engine's refusal dressed as one.

A vLLM engine that is shutting down (SIGTERM with ``--shutdown-timeout``) keeps its HTTP server open: requests
that reach it are rejected by its engine core as *aborted* — HTTP 200 with ``finish_reason: "abort"`` and no
tokens, or a stream that ends (``data: [DONE]``) with nothing in it — and once the core has exited, a stream
carries an error event. None of it is the model's answer; passed on, the client gets HTTP 200 with no tokens. The
router therefore holds a stream back until its first event with content (a token, text, or a real finish) and
retries on another pair when an abort, an error or the end comes first; a whole answer aborted is retried too.
Only the first events of a stream are parsed; the rest pass through as bytes, whole events at a time
(:class:`WholeEvents`), so that a stream that breaks ends with an error event a client can read, never half an
event.
"""

from __future__ import annotations

import json
import re
from enum import Enum

_ABORTED = re.compile(rb'"finish_reason"\s*:\s*"abort"')
#: a stream event is at most this long before its first content; longer: passed on as it is (not our concern)
_MAX_HELD_BYTES = 1 << 20


#: where a Server-Sent Event ends: a blank line, two line endings (LF, CR or CRLF) in a row: each pair holds one of
#: these (CRLF CRLF holds LF CR, its last LF then passed on with what follows)
_EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r")


def _last_event_end(data: bytes | bytearray, start: int = 0) -> int:
    """Where the last event end (:data:`_EVENT_ENDS`, two bytes) in ``data[start:]`` begins, or -1."""
    return max(data.rfind(separator, start) for separator in _EVENT_ENDS)


class Start(Enum):
    PENDING = "pending"  # nothing but role or empty events so far
    STARTED = "started"  # an event with content: the answer is the model's, pass everything on
    FAILED = "failed"  # an abort, an error event or the end came first: retry elsewhere


def aborted(body: bytes) -> bool:
    """A whole (not streamed) answer that an engine aborted: retried, never passed on as HTTP 200."""
    return _ABORTED.search(body) is not None


class StreamStart:
    """Reads a decode stream's first events (Server-Sent Events as vLLM writes them) until it knows.

    Linear in what it holds: each event is judged once, when its end (a blank line) arrives; only the bytes after
    the last complete event are kept apart, and each feed looks only at what it brought."""

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self._size = 0
        self._tail = bytearray()  # the bytes after the last complete event: its next event's beginning
        self.reason = ""

    @property
    def held(self) -> bytes:
        """What was read so far (written to the client once the stream has started)."""
        return b"".join(self._held)

    def feed(self, chunk: bytes) -> Start:
        self._held.append(chunk)
        self._size += len(chunk)
        if self._size > _MAX_HELD_BYTES:
            return Start.STARTED
        seen = max(len(self._tail) - 1, 0)  # the tail holds no event end; one may span it and the chunk
        self._tail += chunk
        end = _last_event_end(self._tail, seen)
        if end < 0:
            return Start.PENDING
        # the events, their line endings (LF, CR or CRLF: Server-Sent Events allow each) read as LF
        events = bytes(self._tail[:end]).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n")
        del self._tail[: end + 2]
        for event in events:
            state = self._judge(event)
            if state is not Start.PENDING:
                return state
        return Start.PENDING

    def end(self) -> Start:
        """The stream ended: started only if an event with content came (its last event may lack its end)."""
        state = Start.STARTED if self._size > _MAX_HELD_BYTES else self._judge(bytes(self._tail))
        self._tail.clear()
        if state is Start.PENDING:
            self.reason = "the stream ended before any token"
            return Start.FAILED
        return state

    def _judge(self, event: bytes) -> Start:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.reason = "the stream ended before any token"
                return Start.FAILED
            try:
                message = json.loads(data)
            except ValueError:
                return Start.STARTED  # not vLLM's framing: not ours to judge
            if not isinstance(message, dict):
                return Start.STARTED
            if "error" in message:
                error = message["error"]
                self.reason = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
                return Start.FAILED
            for choice in message.get("choices") or ():
                state = self._choice(choice)
                if state is not Start.PENDING:
                    return state
        return Start.PENDING

    def _choice(self, choice: object) -> Start:
        if not isinstance(choice, dict):
            return Start.STARTED
        finish = choice.get("finish_reason")
        if finish == "abort":
            self.reason = "the engine aborted the request (shutting down?)"
            return Start.FAILED
        given = choice.get("delta")
        delta: dict[str, object] = given if isinstance(given, dict) else {}
        content = (
            choice.get("text"),
            choice.get("token_ids"),
            delta.get("content"),
            delta.get("reasoning_content"),
            delta.get("tool_calls"),
        )
        if finish is not None or any(content):
            return Start.STARTED
        return Start.PENDING


class WholeEvents:
    """A stream's bytes passed on as whole events: :meth:`feed` returns what ends at an event's end and holds back
    the beginning of the next, so that an error event written after a broken stream is read as one. What is held is
    one event's beginning, at most :data:`_MAX_HELD_BYTES` (an event that long, or a stream that is not Server-Sent
    Events, is passed on as it comes past that). Linear: each feed searches its chunk and the held bytes' last one."""

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> bytes:
        edge = self._held[-1][-1:] if self._held else b""  # an event's end may span the held bytes and the chunk
        probe = edge + chunk if edge else chunk
        end = _last_event_end(probe)
        if end < 0:
            self._held.append(chunk)
            self._size += len(chunk)
            return self.rest() if self._size > _MAX_HELD_BYTES else b""
        cut = end + 2 - len(edge)  # where in the chunk the passed part ends (a held byte never ends an event)
        out = b"".join((*self._held, chunk[:cut])) if self._held else chunk[:cut]
        rest = chunk[cut:]
        self._held, self._size = ([rest], len(rest)) if rest else ([], 0)
        return out

    def rest(self) -> bytes:
        """What is held (at the stream's end: a last event without its blank line)."""
        rest = b"".join(self._held)
        self._held, self._size = [], 0
        return rest
