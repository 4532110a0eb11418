"""How an engine pod ends: the preStop drain (routers first, then the KV prefill holds for readers, bounded by the
lease), vLLM's own drain (--shutdown-timeout) and a grace period that covers both, for every engine kind."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge_agent.core import Role
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import termination
from kvbridge_operator.children.objects.pod import pod_template
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig
from kvbridge_sim.support import free_port


def manifest(kind: str, connector: str = "Nixl", **transfer: Any) -> dict[str, Any]:
    engine = {"kind": kind} | ({"connector": connector, "device": "CPU"} if kind == "VLLM" else {})
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "t"},
        "spec": {
            "engine": engine,
            "model": {"name": "m", "numLayers": 2, "numKVHeads": 2, "headDim": 64},
            "transfer": {"leaseSeconds": 60, **transfer},
            "prefill": {"blockSize": 32},
            "decode": {"blockSize": 32},
        },
    }


def rendered(document: dict[str, Any], role: Role) -> tuple[dict[str, Any], dict[str, Any]]:
    dd = DisaggregatedDeployment.model_validate(document)
    plan = verdict_for(dd)
    assert not isinstance(plan, list), plan
    template = pod_template(dd, role, plan, OperatorConfig())
    return template, next(c for c in template["spec"]["containers"] if c["name"] == "engine")


@pytest.mark.parametrize(
    ("kind", "connector", "role", "gauge", "grace"),
    [
        ("Synthetic", "Nixl", Role.PREFILL, "kvbridge_held_requests", 5 + 60 + 20 + 10),
        ("Synthetic", "Nixl", Role.DECODE, "", 5 + 20 + 10),
        ("VLLM", "KVBridge", Role.PREFILL, "vllm:kvbridge_held_requests", 5 + 60 + 20 + 10),
        ("VLLM", "Nixl", Role.PREFILL, "", 5 + 20 + 10),  # NixlConnector exports nothing to wait on
        ("VLLM", "KVBridge", Role.DECODE, "", 5 + 20 + 10),
    ],
)
def test_every_engine_pod_drains_within_its_grace_period(
    kind: str, connector: str, role: Role, gauge: str, grace: int
) -> None:
    template, container = rendered(manifest(kind, connector, drainSeconds=20), role)
    assert template["spec"]["terminationGracePeriodSeconds"] == grace
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["python3", "-c", termination.DRAIN_SCRIPT]
    assert command[3:] == ["8000", "5", "60" if gauge else "0", gauge]
    if kind == "VLLM":
        args = container["args"]
        assert args[args.index("--shutdown-timeout") + 1] == "20"


def test_shutdown_timeout_in_extra_args_is_refused() -> None:
    document = manifest("VLLM")
    document["spec"]["engine"]["extraArgs"] = ["--shutdown-timeout=5"]
    problems = verdict_for(DisaggregatedDeployment.model_validate(document))
    assert isinstance(problems, list)
    assert [p.code for p in problems] == ["VLLM_MANAGED_ARGUMENT"]
    assert "spec.transfer.drainSeconds" in problems[0].message


class Metrics(http.server.BaseHTTPRequestHandler):
    held = 2.0

    def do_GET(self) -> None:
        body = f'# HELP x\nvllm:kvbridge_held_requests{{engine="0"}} {Metrics.held}\n'.encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


def drain(port: int, lease: float, gauge: str = "vllm:kvbridge_held_requests") -> float:
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", termination.DRAIN_SCRIPT, str(port), "0.2", str(lease), gauge], check=True, timeout=30
    )
    return time.monotonic() - started


def test_the_prestop_waits_until_decode_has_read_what_prefill_holds(engine: int) -> None:
    Metrics.held = 2.0
    threading.Timer(1.5, lambda: setattr(Metrics, "held", 0.0)).start()
    assert 1.5 <= drain(engine, lease=20) < 5


def test_the_prestop_wait_is_bounded_by_the_lease_and_ends_when_the_engine_is_gone(engine: int) -> None:
    Metrics.held = 3.0
    assert 1.0 <= drain(engine, lease=1.0) < 4  # held forever: the lease ends it (the blocks are freed then)
    assert drain(free_port(), lease=20) < 3  # nothing listens: the engine is gone, nothing to wait for
    assert drain(engine, lease=20, gauge="") < 2  # a decode pod, or NixlConnector's prefill: routers only
