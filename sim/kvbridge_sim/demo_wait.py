"""The demo waiting for the operator's verdicts, and for the pods it runs: every deployment Ready or refused as
incompatible, each pod restart reported as it happens with the last lines its engine wrote, and a crash loop
(a pod restarted :data:`CRASH_LOOP_RESTARTS` times) ending the wait at once with that cause instead of at the
timeout."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

from kvbridge_operator.api.names import LABEL_DEPLOYMENT
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.kube import DEPLOYMENTS, PODS, KubeClient
from kvbridge_sim.pod_logs import LogSource, last_lines
from kvbridge_sim.support import until

NAMESPACE = "default"
#: restarts of one pod, while the demo waits for the deployments to become Ready, after which it gives up: its
#: engine exits at start-up each time (a crash loop, what a cluster shows as CrashLoopBackOff); the demo's own
#: prefill kill comes later and is not counted here
CRASH_LOOP_RESTARTS = 3
#: lines of the exited container's log shown when a pod restarts
CRASH_LOG_LINES = 15


class DemoError(Exception):
    pass


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check(interrupted: asyncio.Event | None) -> None:
    if interrupted is not None and interrupted.is_set():
        raise DemoError("interrupted")


def condition(obj: Obj, kind: str) -> Obj:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def short(message: str, limit: int = 100) -> str:
    """One status message in a progress line (the full text is in the report and the events)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _engine_status(pod: Obj) -> Obj:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    found: Obj = statuses[0]
    return found


def exit_of(pod: Obj) -> str:
    """How the pod's last container ended, as its status says (``lastState.terminated``): ``exit code 1``."""
    ended = (_engine_status(pod).get("lastState") or {}).get("terminated") or {}
    return f"exit code {ended['exitCode']}" if "exitCode" in ended else "exit code unknown"


@dataclass
class CrashWatch:
    """Restarts of the pods of the deployments waited for: each reported as it happens (with the last lines of the
    container that exited, where the local kubelet keeps them: ``logs``), and the wait ended (:class:`DemoError`)
    once a pod has restarted :data:`CRASH_LOOP_RESTARTS` times."""

    logs: LogSource | None = None
    seen: dict[str, int] = field(default_factory=dict)

    async def look(self, client: KubeClient, names: list[str]) -> None:
        for name in names:
            for pod in await client.list(PODS, NAMESPACE, f"{LABEL_DEPLOYMENT}={name}"):
                self.restarted(pod)

    def restarted(self, pod: Obj) -> None:
        """Report a restart of ``pod`` not reported yet; raise once it is a crash loop."""
        pod_name = pod["metadata"]["name"]
        restarts = int(_engine_status(pod).get("restartCount") or 0)
        if restarts <= self.seen.get(pod_name, 0):
            return
        self.seen[pod_name] = restarts
        tail = self.tail(pod_name)
        # a restart between two looks is counted, not reported twice: the runner restarts an engine at once
        progress(
            f"  pod {pod_name} restarted (restart {restarts}; its engine ended with {exit_of(pod)}); "
            f"the last lines it wrote:\n{tail}"
        )
        if restarts >= CRASH_LOOP_RESTARTS:
            raise DemoError(
                f"pod {pod_name} restarted {restarts} times while the demo waited for it to become ready (a crash "
                f"loop; its engine ended with {exit_of(pod)}): giving up now rather than at the timeout. The last "
                f"lines it wrote:\n{tail}"
            )

    def tail(self, pod_name: str) -> str:
        """The last lines of the container that exited (the one before the restart), indented."""
        log = self.logs(NAMESPACE, pod_name) if self.logs is not None else None
        path = None if log is None else log.previous or log.current
        lines = last_lines(path, CRASH_LOG_LINES) if path is not None else []
        return "\n".join(f"    | {line}" for line in lines) or "    (no log kept)"


async def wait_for_verdicts(
    client: KubeClient,
    names: list[str],
    timeout: float,
    interrupted: asyncio.Event | None = None,
    logs: LogSource | None = None,
) -> dict[str, Obj]:
    """Until every deployment is Ready or refused as incompatible (its objects then); a pod's restarts reported
    as they happen and a crash loop ending the wait (:class:`CrashWatch`, with the pods' logs from ``logs``)."""
    last = ""
    objects: dict[str, Obj] = {}
    crashes = CrashWatch(logs)

    async def settled() -> bool:
        nonlocal last, objects
        check(interrupted)
        objects = {n: await client.get(DEPLOYMENTS, NAMESPACE, n) or {} for n in names}
        line = "; ".join(
            f"{n}: {short(condition(o, 'Ready').get('message') or 'waiting for the operator')}"
            for n, o in objects.items()
        )
        if line != last:
            progress(f"  {line}")
            last = line
        await crashes.look(client, names)
        return all(
            condition(o, "Compatible").get("status") == "False" or condition(o, "Ready").get("status") == "True"
            for o in objects.values()
        )

    try:
        await until(settled, timeout, "every deployment compatible and Ready, or incompatible", interval=0.5)
    except TimeoutError as exc:
        raise DemoError(f"not settled after {timeout:g} s: {last}") from exc
    return objects
