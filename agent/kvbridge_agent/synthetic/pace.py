"""The synthetic engine's set speed: an engine whose capacity is a rate, not the CPU it runs on.

On machines of two cores a second engine process adds no compute, so scaling out cannot make a CPU-bound engine
faster; an engine that *sleeps* its service time does, as pods on their own GPUs would. Set per pod through its
environment (a role's ``template`` may set them, docs/environment.md), each unset or 0 by default (as fast as it
goes, as before):

- ``KVBRIDGE_SYNTHETIC_PREFILL_MS_PER_TOKEN``: each prefill (``do_remote_decode``) holds the pod's one prefill slot
  for this many milliseconds per prompt token, the others waiting their turn in arrival order;
- ``KVBRIDGE_SYNTHETIC_DECODE_ITL_MS``: a decode generates ``max_tokens`` tokens (16 by default, as OpenAI's), one
  streamed event each, this many milliseconds apart when it decodes alone...
- ``KVBRIDGE_SYNTHETIC_DECODE_ITL_MS_PER_SEQUENCE``: ...and this many more for every other sequence decoding on the
  pod at that moment: a batch that slows as it grows, as a real engine's does (so decode has a capacity the
  planner's ITL target can hit).

Only the OpenAI routes (what a router sends) are paced. The pod exports the ``vllm:`` series kvbridge's planner reads
(docs/autoscaling.md), whatever the pace: requests finished, prompt and generated tokens, prefix-cache queries (no
hits: there is no cache to hit), requests running and waiting, the inter-token latency.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.model import Role
from kvbridge_agent.synthetic.ranks import INVALID_REQUEST, EngineError

PREFILL_MS_PER_TOKEN = "KVBRIDGE_SYNTHETIC_PREFILL_MS_PER_TOKEN"
DECODE_ITL_MS = "KVBRIDGE_SYNTHETIC_DECODE_ITL_MS"
DECODE_ITL_MS_PER_SEQUENCE = "KVBRIDGE_SYNTHETIC_DECODE_ITL_MS_PER_SEQUENCE"
#: the most milliseconds any of them may say (a minute per token is no engine's)
MOST_MS = 60_000.0
#: a request's tokens when it names none (OpenAI's default ``max_tokens``), and the most one may ask for
DEFAULT_OUTPUT_TOKENS = 16
MOST_OUTPUT_TOKENS = 4096
#: how long a prefill waits for the pod's prefill slot before it is refused (503, the router tries elsewhere)
PREFILL_WAIT_SECONDS = 300.0
PREFILL_WAIT_TIMEOUT = "PREFILL_WAIT_TIMEOUT"
#: vLLM's own inter-token latency buckets (vllm/v1/metrics/buckets.py), so Prometheus sees what it would of vLLM
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)


@dataclass(frozen=True, slots=True)
class Pace:
    """How fast the pod's engine is made to be (0: as fast as it goes)."""

    prefill_ms_per_token: float = 0.0
    decode_itl_ms: float = 0.0
    decode_itl_ms_per_sequence: float = 0.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Pace:
        """The pace its variables say; raises :class:`SpecError` (``INVALID_ENVIRONMENT``) naming the one at fault."""

        def read(name: str) -> float:
            text = environ.get(name, "").strip()
            try:
                value = float(text) if text else 0.0
            except ValueError:
                value = float("nan")
            if not 0 <= value <= MOST_MS:  # NaN included
                raise SpecError(
                    f"{name}={text[:40]!r}: give milliseconds from 0 to {MOST_MS:g}",
                    field=name,
                    code="INVALID_ENVIRONMENT",
                )
            return value

        return cls(read(PREFILL_MS_PER_TOKEN), read(DECODE_ITL_MS), read(DECODE_ITL_MS_PER_SEQUENCE))

    @property
    def decodes(self) -> bool:
        """Whether decode generates tokens at a set pace (else it answers at once, with none)."""
        return self.decode_itl_ms > 0 or self.decode_itl_ms_per_sequence > 0

    def itl_seconds(self, sequences: int) -> float:
        """The gap before a sequence's next token with ``sequences`` decoding on the pod (itself included)."""
        return (self.decode_itl_ms + self.decode_itl_ms_per_sequence * max(sequences - 1, 0)) / 1000


class _Slot:
    """One holder at a time, the others served in arrival order; every wait bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[threading.Event] = deque()
        self._busy = False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextmanager
    def held(self, timeout: float) -> Iterator[None]:
        turn = threading.Event()
        with self._lock:
            if self._busy:
                self._queue.append(turn)
            else:
                self._busy = True
                turn.set()
        if not turn.wait(timeout):
            with self._lock:
                if turn in self._queue:  # still waiting: leave the queue (else the slot was handed over just now)
                    self._queue.remove(turn)
                    raise EngineError(
                        f"no prefill slot within {timeout:g} s (the engine is {len(self._queue)} prompts behind)",
                        code=PREFILL_WAIT_TIMEOUT,
                        status=503,
                    )
        try:
            yield
        finally:
            with self._lock:
                if self._queue:
                    self._queue.popleft().set()
                else:
                    self._busy = False


class Pacer:
    """One pod's pace at work: its prefill slot, the sequences it decodes, and the ``vllm:`` series it exports."""

    def __init__(self, pace: Pace, role: Role) -> None:
        self.pace = pace
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self._slot = _Slot()
        self._lock = threading.Lock()
        self._decoding = 0
        registry = self.registry
        self.success = Counter("vllm:request_success", "Requests finished.", ["finished_reason"], registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests served.", registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", registry=registry)
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=registry
        )
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found there (none).", registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests prefilling or decoding now.", registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Prefills waiting for the slot.", registry=registry)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens.", registry=registry, buckets=ITL_BUCKETS
        )
        self.waiting.set_function(lambda: self._slot.waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @contextmanager
    def prefilling(self, tokens: int) -> Iterator[None]:
        """A prefill of ``tokens`` prompt tokens: its turn at the slot and its service time (sleeping), then what
        runs inside; counted as one request finished when that succeeds."""
        with self._slot.held(PREFILL_WAIT_SECONDS):
            self.running.inc()
            try:
                if self.pace.prefill_ms_per_token:
                    time.sleep(tokens * self.pace.prefill_ms_per_token / 1000)
                yield
            finally:
                self.running.dec()
        self.prompt_tokens.inc(tokens)
        self.cache_queries.inc(tokens)
        self.success.labels(finished_reason="length").inc()

    def output_tokens(self, body: Mapping[str, Any]) -> int:
        """The tokens a decode request will get: none unpaced, else its ``max_tokens`` (a 400 outside 1..4096)."""
        if not self.pace.decodes:
            return 0
        wanted = body.get("max_tokens", body.get("max_completion_tokens"))
        wanted = DEFAULT_OUTPUT_TOKENS if wanted is None else wanted
        if not isinstance(wanted, int) or isinstance(wanted, bool) or not 1 <= wanted <= MOST_OUTPUT_TOKENS:
            raise EngineError(
                f"max_tokens must be a whole number from 1 to {MOST_OUTPUT_TOKENS}",
                code=INVALID_REQUEST,
                field="max_tokens",
            )
        return wanted

    def tokens(self, count: int, prompt_tokens: int) -> Generator[int]:
        """Each token's index, when it is due (the first at once: decode's KV was read); the sequence counts as
        decoding until the iterator ends or is closed, and as one request finished once all came."""
        with self._lock:
            self._decoding += 1
            self.running.inc()
        try:
            last = time.monotonic()
            for index in range(count):
                if index:
                    with self._lock:
                        gap = self.pace.itl_seconds(self._decoding)
                    time.sleep(max(0.0, last + gap - time.monotonic()))
                    now = time.monotonic()
                    self.itl.observe(now - last)
                    last = now
                self.generation_tokens.inc()
                yield index
            self.prompt_tokens.inc(prompt_tokens)
            self.success.labels(finished_reason="length").inc()
        finally:
            with self._lock:
                self._decoding -= 1
                self.running.dec()


def paced(
    pacer: Pacer, answer: dict[str, Any], body: Mapping[str, Any], chat: bool, stream: bool
) -> dict[str, Any] | Generator[bytes] | None:
    """What to send for an OpenAI route's ``answer``: a decode's, paced (a whole answer, or its events when
    ``stream``); None: ``answer`` as it is (a prefill's, or a decode's when decode is unpaced: counted here)."""
    if "kv_transfer_params" in answer:
        return None
    count = pacer.output_tokens(body)
    if not count:
        for _ in pacer.tokens(0, int(answer["usage"]["prompt_tokens"])):
            pass
        return None
    if not stream:
        return paced_answer(pacer, answer, count, chat)
    options = body.get("stream_options")
    usage = isinstance(options, Mapping) and options.get("include_usage") is True
    return paced_events(pacer, answer, count, chat, usage)


def _event(data: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def paced_answer(pacer: Pacer, answer: dict[str, Any], count: int, chat: bool) -> dict[str, Any]:
    """A decode's whole answer once its ``count`` tokens came (sleeping their pace)."""
    prompt = int(answer["usage"]["prompt_tokens"])
    generated = sum(1 for _ in pacer.tokens(count, prompt))
    text = " t" * generated
    choice = dict(answer["choices"][0])
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    return dict(answer, choices=[choice], usage=usage)


def paced_events(pacer: Pacer, answer: dict[str, Any], count: int, chat: bool, usage: bool) -> Generator[bytes]:
    """A decode's answer as OpenAI's server-sent events, one per token as it comes (the first carries kvbridge's
    transfer result), then the usage (when asked: ``stream_options.include_usage``) and ``[DONE]``."""
    prompt = int(answer["usage"]["prompt_tokens"])
    head = {k: v for k, v in answer.items() if k not in ("choices", "usage")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    for index in pacer.tokens(count, prompt):
        last = index == count - 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        delta = {"role": "assistant", "content": " t"} if index == 0 else {"content": " t"}
        choice.update({"delta": delta} if chat else {"text": " t"})
        event = dict(head, choices=[choice])
        if index:
            event.pop("kvbridge", None)
        yield _event(event)
    if usage:
        totals = {"prompt_tokens": prompt, "completion_tokens": count, "total_tokens": prompt + count}
        yield _event({k: v for k, v in head.items() if k != "kvbridge"} | {"choices": [], "usage": totals})
    yield b"data: [DONE]\n\n"
