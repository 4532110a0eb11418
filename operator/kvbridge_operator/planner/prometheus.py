"""What the planner reads of a deployment's traffic, through a Prometheus server's HTTP API (PromQL instant queries).

The series are the ones the chart's PodMonitor scrapes, labelled ``namespace``, ``deployment`` and ``role`` (engines)
or ``component="router"`` (the router): vLLM's ``vllm:`` series on the engines, kvbridge's router histogram of the
time to first token its clients see. Over a window ``W`` (at least 4 scrapes):

- request rate: ``sum(rate(vllm:request_success_total{decode}[W]))``;
- mean prompt and output tokens: prefill's ``vllm:prompt_tokens_total`` and decode's
  ``vllm:generation_tokens_total`` rates over their requests' rates;
- prefix hit rate: prefill's ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total`` (tokens);
- TTFT at the target's percentile: the router's ``kvbridge_router_ttft_seconds``, else decode's
  ``vllm:time_to_first_token_seconds`` (without a router); ITL: decode's ``vllm:inter_token_latency_seconds``;
- requests decoding: the window's mean, ``sum(avg_over_time(vllm:num_requests_running{decode}[W]))`` (the load the
  ITL was observed at, not one instant's); staleness: ``time()`` less the newest sample of
  ``vllm:num_requests_running``;
- the bucket bounds of the two histograms the percentiles were read from (``count by (le)`` of their buckets): a
  reading says only which bucket the percentile lies in (planner.buckets).

Every query has a timeout and every answer one bounded schema (:func:`read_answer`): at most
``MAX_ANSWER_BYTES`` read, a vector of at most ``MAX_SERIES`` series or a scalar, each value a number as Prometheus
writes it (``NaN`` and ``±Inf`` included, which the sizing reports where they matter). An answer Prometheus cannot
give (server down, an error, no series) or one of another shape is a :class:`PrometheusError` with a stable code,
which the planner reports and holds on (``MetricsMissing``). What reaches the status and events of the answer itself
is Prometheus' own ``errorType`` and ``error``, cleaned of control characters and cut to ``MAX_SHOWN`` characters,
or the HTTP status of an answer that is not Prometheus': never a body's other content. Redirects are not followed.
"""

from __future__ import annotations

import logging
import math
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from kvbridge_agent.core import KVBridgeError

from .sizing import Observation

log = logging.getLogger(__name__)

#: one query's limit (seconds): a planner pass makes about ten
QUERY_TIMEOUT = 5.0
#: the most of an answer read: an instant query of one series answers a few hundred bytes
MAX_ANSWER_BYTES = 256 * 1024
#: the most series a vector answer may hold (each query sums to one)
MAX_SERIES = 64
#: the longest sample value (Prometheus writes a float64 in at most 25 characters)
MAX_VALUE_CHARS = 64
#: the highest bucket bound taken as one (seconds, a day): past it a bound is no latency's and counts as ``+Inf``
#: (a bound of 1e308 s would be infinite in ms)
MAX_BOUND_SECONDS = 86400.0
#: the longest text of an answer shown in the status and events
MAX_SHOWN = 200

# Stable codes of a query without a usable answer (docs/troubleshooting.md):
#: no HTTP answer: refused, unresolvable, timed out, not HTTP
PROMETHEUS_UNREACHABLE = "PROMETHEUS_UNREACHABLE"
#: an HTTP answer that is not Prometheus' API (another server's page, a redirect)
NOT_PROMETHEUS = "NOT_PROMETHEUS"
#: Prometheus' own error answer (its errorType and error)
PROMETHEUS_ERROR = "PROMETHEUS_ERROR"
#: a success answer without one vector or scalar of numbers
PROMETHEUS_MALFORMED = "PROMETHEUS_MALFORMED"
#: none of the deployment's decode series
PROMETHEUS_NO_SERIES = "PROMETHEUS_NO_SERIES"


class PrometheusError(KVBridgeError):
    """Prometheus did not answer a query usefully; the message is safe to show (it quotes no answer's body beyond
    Prometheus' own error strings, cleaned and cut)."""

    code = PROMETHEUS_UNREACHABLE


@dataclass(frozen=True, slots=True)
class Unanswered:
    """Why an answer holds no number: a stable code and a message safe to show."""

    code: str
    message: str


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` fit for a status or an event: control and format characters (escape sequences, newlines,
    bidirectional overrides) made spaces, at most ``limit`` characters."""
    cleaned = "".join(" " if unicodedata.category(c)[0] in "CZ" and c != " " else c for c in text[: limit * 2])
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # warnings, infos, stats: not read


#: a sample value as Prometheus writes it (Go's strconv.FormatFloat 'f' -1; NaN, +Inf, -Inf)
_NUMBER = r"^([+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?Inf|NaN)$"
_Value = Annotated[str, StringConstraints(max_length=MAX_VALUE_CHARS, pattern=_NUMBER)]
#: [Unix time, value]; a time outside 1970 to 5138 is no Prometheus sample's
_Sample = tuple[Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)], _Value]


#: a label's name or value in an answer (a bucket's ``le`` is a number as written: at most 64 characters)
_Label = Annotated[str, StringConstraints(max_length=MAX_VALUE_CHARS)]


class _Series(_Schema):
    metric: dict[_Label, _Label] = Field(default_factory=dict, max_length=8)
    value: _Sample


class _Vector(_Schema):
    result_type: Literal["vector"] = Field(alias="resultType")
    result: list[_Series] = Field(max_length=MAX_SERIES)


class _Scalar(_Schema):
    result_type: Literal["scalar"] = Field(alias="resultType")
    result: _Sample


class _Success(_Schema):
    status: Literal["success"]
    data: Annotated[_Vector | _Scalar, Field(discriminator="result_type")]


class _Failure(_Schema):
    status: Literal["error"]
    error_type: str = Field(default="", alias="errorType")
    error: str


#: an answer of Prometheus' HTTP API to an instant query (https://prometheus.io/docs/prometheus/latest/querying/api/)
_ANSWER: TypeAdapter[_Success | _Failure] = TypeAdapter(Annotated[_Success | _Failure, Field(discriminator="status")])


def _read(status: int, body: bytes) -> _Success | Unanswered:
    """An answer of HTTP ``status`` and ``body`` validated, or why it says nothing usable. Never raises."""
    foreign = Unanswered(NOT_PROMETHEUS, f"HTTP {status} from the metrics URL (not a Prometheus API answer)")
    if len(body) > MAX_ANSWER_BYTES:
        if status != 200:
            return foreign
        return Unanswered(
            PROMETHEUS_MALFORMED,
            f"HTTP {status}: an answer over {MAX_ANSWER_BYTES // 1024} KiB (one series is a few hundred bytes)",
        )
    try:
        answer = _ANSWER.validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        if status != 200 or not first["loc"] or first["loc"][0] != "success":
            return foreign
        steps: list[str] = []
        for step in first["loc"][1:]:
            if step not in ("vector", "scalar"):
                steps.append(str(step))
            if step == "metric":  # past it a label's name: the body's own content, never shown
                break
        where = ".".join(steps)
        return Unanswered(
            PROMETHEUS_MALFORMED,
            shown(f"a success answer without one vector or scalar of numbers ({where}: {first['type']})"),
        )
    if isinstance(answer, _Failure):
        said = f"{answer.error_type}: {answer.error}" if answer.error_type else answer.error
        return Unanswered(PROMETHEUS_ERROR, shown(f"Prometheus: {said}"))
    if status != 200:
        return foreign
    return answer


def read_answer(status: int, body: bytes) -> float | Unanswered | None:
    """What an answer of HTTP ``status`` and ``body`` says: one number (NaN and ±Inf as Prometheus writes them),
    None (no series), or why it says nothing usable. Never raises."""
    answer = _read(status, body)
    if isinstance(answer, Unanswered):
        return answer
    if isinstance(answer.data, _Scalar):
        return float(answer.data.result[1])
    series = answer.data.result
    if len(series) > 1:
        return Unanswered(PROMETHEUS_MALFORMED, f"{len(series)} series where one was expected")
    return float(series[0].value[1]) if series else None


def read_bounds(status: int, body: bytes) -> tuple[float, ...] | Unanswered:
    """The finite bucket bounds an answer's series are labelled with (``le``; a vector by ``le``), increasing, or why
    it says nothing usable (a series without a numeric ``le``). Bounds below 0 or past :data:`MAX_BOUND_SECONDS`
    are not a latency's and are left out (the range around them is then wider: a smaller correction). Never
    raises."""
    answer = _read(status, body)
    if isinstance(answer, Unanswered):
        return answer
    if isinstance(answer.data, _Scalar):
        return Unanswered(PROMETHEUS_MALFORMED, "a scalar where bucket bounds (a vector by le) were expected")
    found: set[float] = set()
    for series in answer.data.result:
        try:
            found.add(float(series.metric.get("le", "")))
        except ValueError:
            return Unanswered(PROMETHEUS_MALFORMED, "a series without a numeric le label where buckets were expected")
    return tuple(sorted(b for b in found if 0 <= b <= MAX_BOUND_SECONDS))


async def _bounded(response: aiohttp.ClientResponse) -> bytes:
    """The body, read up to one byte over ``MAX_ANSWER_BYTES`` (decompressed, as aiohttp hands it)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            break
    return b"".join(chunks)[: MAX_ANSWER_BYTES + 1]


def _unreachable(exc: BaseException) -> str:
    """Why there was no HTTP answer, in words that hold nothing the other side sent (aiohttp quotes the bytes of a
    malformed HTTP answer in its errors)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {QUERY_TIMEOUT:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unresolvable, TLS: said by this side
        return shown(f"{type(exc).__name__}: {exc}")
    return f"{type(exc).__name__}: no HTTP answer the planner could read"


def _selector(namespace: str, deployment: str, series: str = "", **labels: str) -> str:
    """Label matchers of one deployment's series; a ``vllm:`` series is matched as ``vllm_`` too (an exporter asked
    for OpenMetrics by an older Prometheus escapes the colon: prometheus_client does, vLLM's metrics with it)."""
    parts = [
        f'{key}="{_quoted(value)}"'
        for key, value in {"namespace": namespace, "deployment": deployment, **labels}.items()
    ]
    if series.startswith("vllm:"):
        parts.insert(0, f'__name__=~"vllm[:_]{series.removeprefix("vllm:")}"')
    return "{" + ",".join(parts) + "}"


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def queries(namespace: str, deployment: str, window: str, ttft_q: float, itl_q: float) -> dict[str, str]:
    """The PromQL of every figure of an :class:`Observation`, by name."""

    def prefill(series: str) -> str:
        return _of_role(namespace, deployment, series, "prefill")

    def decode(series: str) -> str:
        return _of_role(namespace, deployment, series, "decode")

    def rate(selected: str) -> str:
        return f"sum(rate({selected}[{window}]))"

    def quantile(q: float, selected: str) -> str:
        return f"histogram_quantile({q}, sum by (le) (rate({selected}[{window}])))"

    return {
        "request_rate": rate(decode("vllm:request_success_total")),
        "prompt_tokens": f"{rate(prefill('vllm:prompt_tokens_total'))} / {rate(prefill('vllm:request_success_total'))}",
        "output_tokens": (
            f"{rate(decode('vllm:generation_tokens_total'))} / {rate(decode('vllm:request_success_total'))}"
        ),
        "prefix_hits": rate(prefill("vllm:prefix_cache_hits_total")),
        "prefix_queries": rate(prefill("vllm:prefix_cache_queries_total")),
        "decode_running": f"sum(avg_over_time({decode('vllm:num_requests_running')}[{window}]))",
        "staleness": f"time() - max(timestamp({decode('vllm:num_requests_running')}))",
        **{
            name: quantile(ttft_q if name.startswith("ttft") else itl_q, selected)
            for name, selected in histograms(namespace, deployment).items()
        },
    }


def histograms(namespace: str, deployment: str) -> dict[str, str]:
    """The bucket series of the histograms the percentiles are read from, by the name of their figure."""
    return {
        "ttft_router": f"kvbridge_router_ttft_seconds_bucket{_selector(namespace, deployment, component='router')}",
        "ttft_decode": _of_role(namespace, deployment, "vllm:time_to_first_token_seconds_bucket", "decode"),
        "itl": _of_role(namespace, deployment, "vllm:inter_token_latency_seconds_bucket", "decode"),
    }


def bounds_query(selected: str, window: str) -> str:
    """The PromQL of a histogram's bucket bounds: its buckets' series over ``window``, one per ``le``."""
    return f"count by (le) (last_over_time({selected}[{window}]))"


def _of_role(namespace: str, deployment: str, series: str, role: str) -> str:
    """A series of one role's engines of the deployment."""
    return _named(series, _selector(namespace, deployment, series, role=role))


def _named(series: str, selector: str) -> str:
    """A series' selector: its name and matchers, or the matchers alone where they name it (``vllm:`` series)."""
    return selector if series.startswith("vllm:") else f"{series}{selector}"


async def _asked(session: aiohttp.ClientSession, url: str, query: str) -> tuple[int, bytes]:
    """One instant query's HTTP status and body (at most ``MAX_ANSWER_BYTES`` and one); raises
    :class:`PrometheusError` without an HTTP answer."""
    try:
        async with session.get(
            f"{url.rstrip('/')}/api/v1/query",
            params={"query": query},
            timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT),
            allow_redirects=False,
        ) as response:
            return response.status, await _bounded(response)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise PrometheusError(f"{query}: {_unreachable(exc)}") from exc


async def instant(session: aiohttp.ClientSession, url: str, query: str) -> float | None:
    """One instant query's single value (None: no series; NaN as Prometheus says it, e.g. 0/0); raises
    :class:`PrometheusError` with the code of what went wrong."""
    answer = read_answer(*await _asked(session, url, query))
    if isinstance(answer, Unanswered):
        raise PrometheusError(f"{query}: {answer.message}", code=answer.code)
    return answer


async def bucket_bounds(session: aiohttp.ClientSession, url: str, query: str) -> tuple[float, ...]:
    """The finite bucket bounds of a histogram, from an instant query of its buckets by ``le``
    (:func:`read_bounds`); raises :class:`PrometheusError` with the code of what went wrong."""
    answer = read_bounds(*await _asked(session, url, query))
    if isinstance(answer, Unanswered):
        raise PrometheusError(f"{query}: {answer.message}", code=answer.code)
    return answer


#: the bounds last read per (Prometheus, query): a histogram's buckets change only with a new engine version, so a
#: pass whose bounds query fails uses these rather than holding (bounded: the oldest go first)
_KNOWN_BOUNDS: OrderedDict[tuple[str, str], tuple[float, ...]] = OrderedDict()
MAX_KNOWN_BOUNDS = 1024


async def known_bounds(session: aiohttp.ClientSession, url: str, query: str) -> tuple[float, ...]:
    """:func:`bucket_bounds`, or where that fails, the bounds last read for the same query (the failure is raised
    when there are none)."""
    key = (url, query)
    try:
        bounds = await bucket_bounds(session, url, query)
    except PrometheusError as exc:
        if key not in _KNOWN_BOUNDS:
            raise
        log.warning("bucket bounds unreadable (%s, %s): the last read are used", exc.code, shown(str(exc)))
        return _KNOWN_BOUNDS[key]
    _KNOWN_BOUNDS[key] = bounds
    _KNOWN_BOUNDS.move_to_end(key)
    while len(_KNOWN_BOUNDS) > MAX_KNOWN_BOUNDS:
        _KNOWN_BOUNDS.popitem(last=False)
    return bounds


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


async def observe(
    session: aiohttp.ClientSession,
    url: str,
    namespace: str,
    deployment: str,
    window: str,
    ttft_percentile: float,
    itl_percentile: float,
) -> Observation:
    """The deployment's traffic over ``window`` (a PromQL duration); raises :class:`PrometheusError`."""
    wanted = queries(namespace, deployment, window, ttft_percentile / 100, itl_percentile / 100)
    got = {name: await instant(session, url, query) for name, query in wanted.items()}
    if got["request_rate"] is None or got["decode_running"] is None or got["staleness"] is None:
        raise PrometheusError(
            f"no vllm: series of decode engines labelled namespace={namespace!r}, deployment={deployment!r}, "
            "role='decode' (is the PodMonitor scraping them?)",
            code=PROMETHEUS_NO_SERIES,
        )
    hits, lookups = got["prefix_hits"], got["prefix_queries"]
    ttft_from = "ttft_router" if _finite(got["ttft_router"]) is not None else "ttft_decode"
    ttft, itl = _finite(got[ttft_from]), _finite(got["itl"])
    selected = histograms(namespace, deployment)
    ttft_bounds = () if ttft is None else await known_bounds(session, url, bounds_query(selected[ttft_from], window))
    itl_bounds = () if itl is None else await known_bounds(session, url, bounds_query(selected["itl"], window))
    return Observation(
        request_rate=got["request_rate"],
        prompt_tokens=math.nan if got["prompt_tokens"] is None else got["prompt_tokens"],
        output_tokens=math.nan if got["output_tokens"] is None else got["output_tokens"],
        prefix_hit_rate=hits / lookups if hits is not None and lookups else 0.0,
        decode_running=got["decode_running"],
        ttft_ms=None if ttft is None else 1000 * ttft,
        itl_ms=None if itl is None else 1000 * itl,
        staleness_seconds=got["staleness"],
        ttft_bounds_ms=tuple(1000 * b for b in ttft_bounds),
        itl_bounds_ms=tuple(1000 * b for b in itl_bounds),
    )
