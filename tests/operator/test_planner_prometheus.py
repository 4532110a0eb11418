"""kvbridge's planner reads a real Prometheus server (Debian's ``prometheus``, started here) scraping exporters of
vLLM's and the router's series, labelled as the chart's PodMonitor labels them; and what it does when Prometheus is
down or knows nothing of the deployment.

Skipped, saying why, where ``prometheus`` is not installed (``make setup`` installs it as root); under CI=true its
absence fails the test instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvbridge_operator.kube import CONFIG_MAPS
from kvbridge_operator.planner.prometheus import PrometheusError, observe
from kvbridge_sim.cluster import cluster
from kvbridge_sim.support import free_port, wait_until

from .test_operator import example
from .test_scaling import replicas

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"),
    reason="no prometheus binary (apt-get install prometheus; make setup does as root)",
)
NAMESPACE, DEPLOYMENT = "team-a", "llama"
#: per tick of the traffic driver (every TICK seconds): one request through prefill and decode
TICK = 0.05
PROMPT, CACHED, OUTPUT = 1000, 400, 100


class Traffic:
    """Exporters of a prefill engine's, a decode engine's and the router's series, and a thread driving them."""

    def __init__(self) -> None:
        self.registries = {name: CollectorRegistry() for name in ("prefill", "decode", "router")}
        p, d, r = (self.registries[n] for n in ("prefill", "decode", "router"))
        self.prefill_success = Counter("vllm:request_success", "", registry=p)
        self.prompt = Counter("vllm:prompt_tokens", "", registry=p)
        self.hits = Counter("vllm:prefix_cache_hits", "", registry=p)
        self.queries = Counter("vllm:prefix_cache_queries", "", registry=p)
        self.decode_success = Counter("vllm:request_success", "", registry=d)
        self.generated = Counter("vllm:generation_tokens", "", registry=d)
        self.running = Gauge("vllm:num_requests_running", "", registry=d)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", registry=d, buckets=(0.01, 0.025, 0.05, 0.1))
        self.decode_ttft = Histogram("vllm:time_to_first_token_seconds", "", registry=d, buckets=(0.05, 0.1, 1.0))
        self.ttft = Histogram("kvbridge_router_ttft_seconds", "", registry=r, buckets=(0.1, 0.2, 0.5, 1.0))
        self.ports = {name: free_port() for name in self.registries}
        self.servers = [start_http_server(self.ports[n], "127.0.0.1", self.registries[n]) for n in self.registries]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drive, daemon=True)
        self.thread.start()

    def _drive(self) -> None:
        self.running.set(40)
        while not self.stop.wait(TICK):
            self.prefill_success.inc()
            self.prompt.inc(PROMPT)
            self.queries.inc(PROMPT)
            self.hits.inc(CACHED)
            self.decode_success.inc()
            self.generated.inc(OUTPUT)
            self.itl.observe(0.02)
            self.decode_ttft.observe(0.07)
            self.ttft.observe(0.15)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for server, _thread in self.servers:
            server.shutdown()


#: the deployments the exporters' series are labelled for (each target scraped once per deployment): the first for
#: the queries alone, the second for the operator's planner on the emulated cluster
LABELLED = ((NAMESPACE, DEPLOYMENT), ("default", "llama3-8b"))


def _config(traffic: Traffic) -> str:
    def job(name: str, labels: str, namespace: str, deployment: str) -> str:
        return (
            f"  - job_name: {name}-{deployment}\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{traffic.ports[name]}']\n"
            f"        labels: {{namespace: {namespace}, deployment: {deployment}, {labels}}}\n"
        )

    jobs = [
        job(name, labels, namespace, deployment)
        for namespace, deployment in LABELLED
        for name, labels in (("prefill", "role: prefill"), ("decode", "role: decode"), ("router", "component: router"))
    ]
    return "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n" + "".join(jobs)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server scraping the three exporters every second; its URL, once every series has a rate."""
    assert PROMETHEUS is not None, "CI=true: Debian's prometheus must be installed (make setup)"
    folder = tmp_path_factory.mktemp("prometheus")
    traffic = Traffic()
    (folder / "prometheus.yml").write_text(_config(traffic))
    port = free_port()
    log = (folder / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), 60, "Prometheus ready")
        # rates over 5 s need two scrapes in the window (Prometheus offsets each target's first scrape)
        wait_until(lambda: _holds_rates(url), 60, "two scrapes of every exporter", interval=0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
        traffic.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _holds_rates(url: str) -> bool:
    """Two samples of each exporter's counters within the last 5 s (what a 5 s rate needs)."""
    for series in ('{__name__=~"vllm[:_]request_success_total"}', "kvbridge_router_ttft_seconds_count"):
        query = urllib.parse.urlencode({"query": f"count(count_over_time({series}[5s]) >= 2)"})
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as answer:
            result = json.load(answer)["data"]["result"]
        wanted = 2 * len(LABELLED) if series.startswith("{") else len(LABELLED)
        if not result or int(result[0]["value"][1]) < wanted:
            return False
    return True


async def test_the_planner_reads_the_deployments_traffic_from_prometheus(prometheus: str) -> None:
    async with aiohttp.ClientSession() as session:
        seen = await observe(session, prometheus, NAMESPACE, DEPLOYMENT, "5s", 95, 95)
    assert 0.5 / TICK * 0.5 < seen.request_rate < 1.5 / TICK  # one request per tick (the thread lags a little)
    assert seen.prompt_tokens == pytest.approx(PROMPT, rel=0.05)
    assert seen.output_tokens == pytest.approx(OUTPUT, rel=0.05)
    assert seen.prefix_hit_rate == pytest.approx(CACHED / PROMPT, rel=0.05)
    assert seen.decode_running == 40
    assert seen.ttft_ms is not None
    assert 100 < seen.ttft_ms <= 200  # the router's histogram (decode's own says 70 ms)
    assert seen.itl_ms is not None
    assert 10 < seen.itl_ms <= 25
    assert seen.ttft_bounds_ms == pytest.approx((100, 200, 500, 1000))  # the router's buckets, +Inf left out
    assert seen.itl_bounds_ms == pytest.approx((10, 25, 50, 100))  # the readings' buckets: (100, 200] and (10, 25]
    assert 0 <= seen.staleness_seconds < 5


async def test_a_deployment_prometheus_knows_nothing_of_is_an_error_naming_the_labels(prometheus: str) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(PrometheusError, match="deployment='other'"):
            await observe(session, prometheus, NAMESPACE, "other", "5s", 95, 95)


async def test_prometheus_down_or_not_prometheus_is_an_error_not_a_hang(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        with pytest.raises(PrometheusError, match=r"ClientConnectorError|Connect"):
            await observe(session, f"http://127.0.0.1:{free_port()}", NAMESPACE, DEPLOYMENT, "5s", 95, 95)
        assert time.monotonic() - started < 10
        traffic = Traffic()  # an exporter is not Prometheus: its /api/v1/query answers metrics text
        try:
            with pytest.raises(PrometheusError):
                await observe(
                    session, f"http://127.0.0.1:{traffic.ports['decode']}", NAMESPACE, DEPLOYMENT, "5s", 95, 95
                )
        finally:
            traffic.close()


#: what one engine of each role does, for the planner on the emulated cluster. With the traffic above (10-20
#: requests/s of 1,000 prompt tokens, 40 % cached, 100 output tokens): 600 uncached tokens take 75 ms, whose p95 in
#: a queue is 3x that, 225 ms of a 500 ms TTFT, so an engine may be 55 % busy (4,400 tokens/s) and prefill needs 2-3
#: engines before the planner's refinement; decode runs 11 requests per engine within a 30 ms ITL (367 tokens/s)
#: and needs 3-6
PROFILE = {
    "engine": "test exporters",
    "prefill": {"tokensPerSecond": 8000},
    "decode": {"contextTokens": 1100, "points": [{"concurrency": 1, "itlMs": 10}, {"concurrency": 16, "itlMs": 40}]},
}


async def test_the_operators_planner_sizes_both_roles_and_holds_when_prometheus_is_gone(prometheus: str) -> None:
    """The real operator on the emulated API server, spec.autoscaling on: it writes both roles' /scale from what
    Prometheus says, the StatefulSets follow, status.autoscaling says why; Prometheus gone, it holds the sizes and
    says so in a Warning event and the status."""
    async with cluster() as c:
        await c.client.create(
            CONFIG_MAPS,
            "default",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "profile"},
                "data": {"profile.json": json.dumps(PROFILE)},
            },
        )
        document = example("synthetic/llama3-8b-hetero-tp")
        document["spec"]["prefill"]["maxReplicas"] = 16
        document["spec"]["decode"]["maxReplicas"] = 16
        document["spec"]["autoscaling"] = {
            "enabled": True,
            "prometheusUrl": prometheus,
            "ttft": {"milliseconds": 500},
            "itl": {"milliseconds": 30, "percentile": 90},
            "profile": {"name": "profile"},
            "intervalSeconds": 5,
            "windowSeconds": 5,
            "stabilizationWindowSeconds": 0,
        }
        await c.apply(document)

        def planned() -> dict[str, Any]:
            found: dict[str, Any] = c.deployment("llama3-8b").get("status", {}).get("autoscaling") or {}
            return found

        await c.wait(lambda: planned().get("state") == "Sized", timeout=60, what="a planner pass")
        status = planned()
        assert 2 <= status["prefill"] <= 16, status
        assert 3 <= status["decode"] <= 6, status
        assert status["planned"] == f"{status['prefill']}/{status['decode']}"
        assert status["prefixHitRate"] == pytest.approx(CACHED / PROMPT, rel=0.05)
        for role in ("prefill", "decode"):
            await c.wait(
                lambda role=role: replicas(c, f"llama3-8b-{role}") == planned()[role],  # type: ignore[misc]
                timeout=30,
                what=f"the {role} StatefulSet follows the planner",
            )
        await c.wait(lambda: "Planned" in c.reasons("llama3-8b"), what="the Planned event")

        sizes = (planned()["prefill"], planned()["decode"])
        await c.patch_spec("llama3-8b", {"autoscaling": {"prometheusUrl": f"http://127.0.0.1:{free_port()}"}})
        await c.wait(lambda: planned().get("state") == "MetricsMissing", timeout=60, what="the planner holding")
        assert planned()["held"] is True
        assert (planned()["prefill"], planned()["decode"]) == sizes
        assert (replicas(c, "llama3-8b-prefill"), replicas(c, "llama3-8b-decode")) == sizes
        # kopf posts events from its own queue, so the event may land just after the status patch
        await c.wait(
            lambda: any(
                e["reason"] == "PlannerHeld" and "MetricsMissing" in e["message"] for e in c.events("llama3-8b")
            ),
            timeout=10,
            what="the PlannerHeld event",
        )
