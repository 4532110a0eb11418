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
- requests decoding now: ``sum(vllm:num_requests_running{decode})``; staleness: ``time()`` less the newest sample
  of ``vllm:num_requests_running``.

Every query has a timeout; an answer Prometheus cannot give (server down, an error, no series) is a
:class:`PrometheusError` naming the query, which the planner reports and holds on.
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp

from .sizing import Observation

#: one query's limit (seconds): a planner pass makes about ten
QUERY_TIMEOUT = 5.0


class PrometheusError(Exception):
    """Prometheus did not answer a query usefully."""


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
        return _named(series, _selector(namespace, deployment, series, role="prefill"))

    def decode(series: str) -> str:
        return _named(series, _selector(namespace, deployment, series, role="decode"))

    router = _selector(namespace, deployment, component="router")

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
        "decode_running": f"sum({decode('vllm:num_requests_running')})",
        "staleness": f"time() - max(timestamp({decode('vllm:num_requests_running')}))",
        "ttft_router": quantile(ttft_q, f"kvbridge_router_ttft_seconds_bucket{router}"),
        "ttft_decode": quantile(ttft_q, decode("vllm:time_to_first_token_seconds_bucket")),
        "itl": quantile(itl_q, decode("vllm:inter_token_latency_seconds_bucket")),
    }


def _named(series: str, selector: str) -> str:
    """A series' selector: its name and matchers, or the matchers alone where they name it (``vllm:`` series)."""
    return selector if series.startswith("vllm:") else f"{series}{selector}"


async def instant(session: aiohttp.ClientSession, url: str, query: str) -> float | None:
    """One instant query's single value (None: no series; NaN as Prometheus says it, e.g. 0/0)."""
    try:
        async with session.get(
            f"{url.rstrip('/')}/api/v1/query",
            params={"query": query},
            timeout=aiohttp.ClientTimeout(total=QUERY_TIMEOUT),
        ) as response:
            body: Any = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise PrometheusError(f"{query}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error", body) if isinstance(body, dict) else body
        raise PrometheusError(f"{query}: {str(error)[:300]}")
    result = body.get("data", {}).get("result")
    if body.get("data", {}).get("resultType") == "scalar" and isinstance(result, list) and len(result) == 2:
        return float(result[1])
    if not isinstance(result, list) or not result:
        return None
    if len(result) > 1:
        raise PrometheusError(f"{query}: {len(result)} series where one was expected")
    try:
        return float(result[0]["value"][1])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PrometheusError(f"{query}: an answer without a value ({exc})") from exc


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
            "role='decode' (is the PodMonitor scraping them?)"
        )
    hits, lookups = got["prefix_hits"], got["prefix_queries"]
    ttft = _finite(got["ttft_router"])
    ttft = ttft if ttft is not None else _finite(got["ttft_decode"])
    itl = _finite(got["itl"])
    return Observation(
        request_rate=got["request_rate"],
        prompt_tokens=math.nan if got["prompt_tokens"] is None else got["prompt_tokens"],
        output_tokens=math.nan if got["output_tokens"] is None else got["output_tokens"],
        prefix_hit_rate=hits / lookups if hits is not None and lookups else 0.0,
        decode_running=got["decode_running"],
        ttft_ms=None if ttft is None else 1000 * ttft,
        itl_ms=None if itl is None else 1000 * itl,
        staleness_seconds=got["staleness"],
    )
