"""How an engine pod ends when it is deleted (scale-down, rollout, drain): without losing a request.

The sequence, for both roles and every engine:

1. The pod gets its deletion timestamp: the operator drops it from ``status.<role>.endpoints`` (it counts only
   ready pods without one), so routers stop choosing it.
2. ``preStop`` (the engine container's): wait :data:`ROUTE_GRACE_SECONDS` for routers to see that; then, on a
   prefill pod whose engine exports what it holds for readers (kvbridge's connector and the synthetic engine:
   ``kvbridge_held_requests`` after the engine kind's metrics prefix), wait until decode has read it all, at most
   the lease (after which the blocks are freed anyway). vLLM's NixlConnector exports no such figure: its prefill
   pods wait only for the routers.
3. SIGTERM: vLLM drains the requests it has (``--shutdown-timeout``, ``spec.transfer.drainSeconds``) and exits.
4. ``terminationGracePeriodSeconds`` covers all of it with a margin, so the kubelet's SIGKILL never cuts a drain.

A request that still meets the pod (a router that had not seen the status, a drain that answered 5xx) fails
before its first byte and the router retries it on another pair (kvbridge_router.proxy).
"""

from __future__ import annotations

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import ENGINE_CONTAINER
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.children.engines import engine_of

#: the gauge of the requests whose KV a prefill engine holds for readers (after the engine kind's metrics prefix)
HELD_REQUESTS = "kvbridge_held_requests"
#: how long a deleted pod keeps serving so that routers watching the status stop sending it requests
ROUTE_GRACE_SECONDS = 5
#: added to the grace period beyond the waits and the drain (process exit, the kubelet's own latency)
MARGIN_SECONDS = 10
#: the preStop wait: routers first, then (prefill) the KV held for readers, read from the engine's /metrics
DRAIN_SCRIPT = """\
import os, sys, time, urllib.request
port, route_grace, lease, gauge = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
host = os.environ.get("KVBRIDGE_DRAIN_HOST", "127.0.0.1")
time.sleep(route_grace)
deadline = time.monotonic() + lease
while gauge and time.monotonic() < deadline:
    try:
        text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2).read().decode()
    except OSError:
        break
    held = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((gauge + "{", gauge + " ")))
    if held <= 0:
        break
    time.sleep(1)
"""


def held_gauge(spec: DisaggregatedDeploymentSpec, role: Role) -> str:
    """The metric a prefill engine exports for the KV it holds for readers: kvbridge's transfer layer exports it
    (under the engine kind's prefix); empty where none is exported."""
    kind = engine_of(spec)
    if role is not Role.PREFILL or not kind.kvbridge_transfer(spec):
        return ""
    return kind.metrics_prefix + HELD_REQUESTS


def held_wait_seconds(spec: DisaggregatedDeploymentSpec, role: Role) -> int:
    """The longest the preStop waits for decode to read what the pod holds: the lease, where there is a figure."""
    return spec.transfer.lease_seconds if held_gauge(spec, role) else 0


def grace_seconds(spec: DisaggregatedDeploymentSpec, role: Role) -> int:
    """``terminationGracePeriodSeconds``: the preStop waits, the engine's drain and a margin."""
    return ROUTE_GRACE_SECONDS + held_wait_seconds(spec, role) + spec.transfer.drain_seconds + MARGIN_SECONDS


def apply(template: Obj, spec: DisaggregatedDeploymentSpec, role: Role, port: int) -> Obj:
    """``template`` (changed in place and returned) with the engine container's preStop drain and the pod's grace
    period; ``port`` is the engine's HTTP port (its /metrics)."""
    template["spec"]["terminationGracePeriodSeconds"] = grace_seconds(spec, role)
    command = [
        "python3",
        "-c",
        DRAIN_SCRIPT,
        str(port),
        str(ROUTE_GRACE_SECONDS),
        str(held_wait_seconds(spec, role)),
        held_gauge(spec, role),
    ]
    for container in template["spec"]["containers"]:
        if container.get("name") == ENGINE_CONTAINER:
            container["lifecycle"] = {"preStop": {"exec": {"command": command}}}
    return template
