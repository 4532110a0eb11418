"""Pure: which pods are still cold for a kind of request, and so get ``cold_timeout`` instead of the usual bounds.

An engine compiles the paths a request takes the first time one takes them: vLLM's CPU build compiles its sampler's
logprobs on the first request that asks for them (60-90 s where a warm request takes a second), and a first request
with a structured output builds its grammar backend. The usual bounds (``prefill_timeout``, a stream's 60 s between
chunks) would cut such a request off, and the retry on another pod, as cold, would be cut off too. So a pod's first
call of each :func:`kind` of request is bounded by ``cold_timeout`` instead (never past the request's own
``request_timeout``); once the pod has answered that kind, or let the longer bound pass, it gets the usual ones. A
pod that restarts or is replaced is cold again (``keep_only``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: request fields whose presence takes an engine down a path of its own, by the kind's name: the sampler's logprobs,
#: the prompt's logprobs (``echo`` with logprobs asks for them too), a structured output's grammar
_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logprobs", ("logprobs", "top_logprobs")),
    ("prompt_logprobs", ("prompt_logprobs", "echo")),
    (
        "structured",
        ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
    ),
)


def kind(route: str, body: Mapping[str, object]) -> str:
    """A request's kind, as far as an engine's first-time paths go: its route and the paths it asks for
    (``completions``, ``chat+logprobs``, ...)."""
    paths = [name for name, fields in _PATHS if any(_asks(body.get(field)) for field in fields)]
    return "+".join((route, *paths))


def _asks(value: object) -> bool:
    """Whether a field's value asks for its path (absent, null, false and 0 do not; ``logprobs: 0`` does in
    completions, but takes the same path as any other number, so it counts)."""
    if value is None or value is False:
        return False
    # response_format {"type": "text"} builds no grammar
    return not (isinstance(value, dict) and value.get("type") == "text")


class Warmth:
    """The kinds of request each pod has answered (or let ``cold_timeout`` pass on)."""

    def __init__(self) -> None:
        self._warm: dict[str, set[str]] = {}

    def cold(self, pod: str, kind: str) -> bool:
        return kind not in self._warm.get(pod, ())

    def warmed(self, pod: str, kind: str) -> None:
        """``pod`` answered a call of ``kind``, or its longer bound passed: the usual bounds from now on."""
        self._warm.setdefault(pod, set()).add(kind)

    def keep_only(self, pods: Iterable[str]) -> None:
        """Forget the pods not in ``pods`` (gone, restarted or replaced: cold again when they return)."""
        kept = set(pods)
        for pod in [pod for pod in self._warm if pod not in kept]:
            del self._warm[pod]
