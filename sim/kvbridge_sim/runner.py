"""A local stand-in for the StatefulSet controller and the kubelet — on this machine, not a cluster.

For every StatefulSet the operator created it creates the pods, gives each
its own loopback address (127.A.B.N, a /24 of this process's own, so every pod can bind the real ports),
mounts the side-channel Secret as files, resolves the downward-API
variables, runs the engine container's own command as a local process
(``kvbridge-agent serve``, or the rendered ``vllm serve`` line with the model
mapped to a local folder; see :mod:`.pods`), gives pods with CPU limits whole
cores of their own (as a static CPU manager would), reports readiness (the
container's readiness probe path), IP and restarts into pod status, restarts
a process that exits (as a kubelet would), and stops everything on close.

Pods end as on a cluster: a pod deleted through the API by anyone (an eviction, a node drain) or one above the
StatefulSet's replicas, or of an older revision (a rolling update: highest ordinal first, one at a time, once the
others are ready, above the partition), is deleted through the API
(a finalizer of this stand-in's keeps it visible with its deletion timestamp, as a real pod is while it
terminates); then its container's ``preStop`` runs, SIGTERM goes to its main process, SIGKILL follows after the
pod's ``terminationGracePeriodSeconds``, and the pod object goes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvbridge_agent.core.contract import PREFIX
from kvbridge_operator.api.names import LABEL_REVISION, MANAGED_BY, router_token_secret_name, secret_name
from kvbridge_operator.api.objects import Obj, now_rfc3339
from kvbridge_operator.children.transfer_token import TOKEN_KEY
from kvbridge_operator.kube import PODS, SECRETS, STATEFUL_SETS, KubeClient
from kvbridge_sim import pods
from kvbridge_sim.pod_logs import PodLog
from kvbridge_sim.support import pod_addresses

#: keeps a deleted pod visible (with its deletion timestamp) until this stand-in has ended its container
KUBELET_FINALIZER = "kvbridge.io/local-kubelet"


@dataclass
class LocalPod:
    namespace: str
    name: str
    deployment: str
    ip: str
    spec: pods.LocalPodSpec
    #: the pod's template as created (its preStop and grace period)
    template: Obj
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    log_path: Path | None = None
    revision: str = ""
    terminating: bool = False
    #: the running container's start, and how the one before it ended (``lastState.terminated``), as a kubelet
    #: reports them
    started_at: str = ""
    last_state: Obj | None = None


class LocalRunner:
    def __init__(self, client: KubeClient, workdir: Path, models: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.workdir = workdir
        self.models = dict(models or {})
        self.pods: dict[tuple[str, str], LocalPod] = {}
        self._addresses = pod_addresses()
        self._next_core = 0
        self._cores = sorted(os.sched_getaffinity(0))
        self._session: aiohttp.ClientSession | None = None
        self._endings: set[asyncio.Task[None]] = set()

    # -- lifetime -------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sync()
            except Exception as exc:  # keep the stand-in alive; the demo reports what fails
                print(f"  local runner: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.2)

    async def close(self) -> None:
        for task in list(self._endings):
            task.cancel()
        await asyncio.gather(*self._endings, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(pods.stop, p.process) for p in self.pods.values() if p.process))
        if self._session is not None:
            await self._session.close()

    def crash(self, namespace: str, name: str) -> None:
        """Kill a pod's engine at once, with every process it started (vLLM's engine core and workers, the agent's
        ranks), as an OOM kill or a node failure would."""
        pod = self.pods[(namespace, name)]
        if pod.process is not None and pod.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.process.pid, signal.SIGKILL)

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.pods.values() if p.process is not None]

    # -- reconciling pods -------------------------------------------------------------
    async def sync(self) -> None:
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        wanted: set[tuple[str, str]] = set()
        for sts in await self.client.list(STATEFUL_SETS, None, selector):
            namespace, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
            replicas = int(sts["spec"].get("replicas", 0))
            wanted |= {(namespace, f"{name}-{index}") for index in range(replicas)}
            for index in range(replicas):
                key = (namespace, f"{name}-{index}")
                if key not in self.pods:
                    await self._create(sts, key[1])
            self._roll(sts, replicas)
        deleted = {
            (p["metadata"]["namespace"], p["metadata"]["name"])
            for p in await self.client.list(PODS, None, selector)
            if p["metadata"].get("deletionTimestamp")
        }
        for key, pod in list(self.pods.items()):
            # scaled down, its StatefulSet gone, or deleted by someone else (an eviction, a node drain)
            if (key not in wanted or key in deleted) and not pod.terminating:
                self._end(pod)
        for pod in list(self.pods.values()):
            if not pod.terminating:
                await self._watch(pod)

    def _roll(self, sts: Obj, replicas: int) -> None:
        """RollingUpdate: the highest-ordinal pod of an older revision at or above the partition is replaced, one
        at a time, once every other pod is ready (as the StatefulSet controller does)."""
        namespace, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
        revision = sts["spec"]["template"]["metadata"].get("labels", {}).get(LABEL_REVISION, "")
        update = (sts["spec"].get("updateStrategy") or {}).get("rollingUpdate") or {}
        partition = int(update.get("partition", 0))
        mine = {i: self.pods.get((namespace, f"{name}-{i}")) for i in range(replicas)}
        present = {i: p for i, p in mine.items() if p is not None and not p.terminating}
        if len(present) < replicas:  # a pod is being replaced or created
            return
        stale = sorted((i for i, p in present.items() if i >= partition and p.revision != revision), reverse=True)
        if stale and all(p.ready for i, p in present.items() if i != stale[0]):
            self._end(present[stale[0]])

    def _end(self, pod: LocalPod) -> None:
        pod.terminating = True
        task = asyncio.create_task(self._terminate(pod))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    async def _terminate(self, pod: LocalPod) -> None:
        """A kubelet ending a deleted pod: the deletion timestamp (routers stop sending), preStop, SIGTERM, at
        most the grace period, SIGKILL, then the pod object goes (its finalizer released)."""
        grace = float(pod.template["spec"].get("terminationGracePeriodSeconds", 30))
        started = asyncio.get_running_loop().time()
        with contextlib.suppress(Exception):
            await self.client.delete(PODS, pod.namespace, pod.name)
        pre_stop = (pods.engine_container(pod.template).get("lifecycle") or {}).get("preStop", {}).get("exec", {})
        if pre_stop.get("command") and pod.process is not None and pod.process.poll() is None:
            environ = {**os.environ, **pod.spec.env, "KVBRIDGE_DRAIN_HOST": pod.ip}
            quiet = subprocess.DEVNULL
            hook = await asyncio.create_subprocess_exec(*pre_stop["command"], env=environ, stdout=quiet, stderr=quiet)
            try:
                await asyncio.wait_for(hook.wait(), timeout=grace)
            except TimeoutError:
                hook.kill()
                await hook.wait()
        if pod.process is not None:
            left = grace - (asyncio.get_running_loop().time() - started)
            await asyncio.to_thread(pods.terminate, pod.process, left)
        with contextlib.suppress(Exception):
            await self.client.patch(PODS, pod.namespace, pod.name, {"metadata": {"finalizers": None}})
        self.pods.pop((pod.namespace, pod.name), None)

    async def _create(self, sts: Obj, pod_name: str) -> None:
        namespace = sts["metadata"]["namespace"]
        template = copy.deepcopy(sts["spec"]["template"])
        labels = template["metadata"].get("labels", {})
        deployment = labels.get("kvbridge.io/deployment", "")
        ip = next(self._addresses)
        keys_dir = await self._mount_secret(namespace, secret_name(deployment), f"{deployment}-keys")
        overrides = {"KVBRIDGE_KEYS_DIR": str(keys_dir), "KVBRIDGE_HTTP_HOST": ip}
        if any(e.get("name") == TOKEN_ENV for e in pods.engine_container(template).get("env", [])):
            token_dir = await self._mount_secret(namespace, router_token_secret_name(deployment), f"{deployment}-token")
            overrides[TOKEN_ENV] = str(token_dir / TOKEN_KEY)
        spec = pods.local_pod(
            template,
            pod_name,
            ip,
            self.workdir / pod_name,
            models=self.models,
            cpus=self._cpuset(template),
            env_overrides=overrides,
        )
        owner = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": sts["metadata"]["name"],
            "uid": sts["metadata"]["uid"],
            "controller": True,
        }
        pod_obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": template["spec"],
            "metadata": {
                **template["metadata"],
                "name": pod_name,
                "ownerReferences": [owner],
                "finalizers": [KUBELET_FINALIZER],
            },
        }
        await self.client.create(PODS, namespace, pod_obj)
        pod = LocalPod(
            namespace,
            pod_name,
            deployment,
            ip,
            spec,
            template,
            log_path=self.workdir / f"{pod_name}.log",
            revision=labels.get(LABEL_REVISION, ""),
        )
        self.pods[(namespace, pod_name)] = pod
        self._start(pod)
        await self._report(pod)

    def _cpuset(self, template: Obj) -> tuple[int, ...]:
        """Whole cores for a container with CPU limits (what a static CPU manager gives a Guaranteed pod)."""
        container = pods.engine_container(template)
        if "cpu" not in container.get("resources", {}).get("limits", {}):
            return ()
        count = min(pods.cpu_request(container), len(self._cores))
        chosen = tuple(sorted(self._cores[(self._next_core + i) % len(self._cores)] for i in range(count)))
        self._next_core = (self._next_core + count) % len(self._cores)
        return chosen

    async def _mount_secret(self, namespace: str, name: str, folder: str) -> Path:
        """A Secret's keys as files (owner-readable) in a folder of the work directory, as a kubelet mounts a Secret
        volume: the side channel's keys, the router's token (spec.router.signTransfers)."""
        path = self.workdir / f"{namespace}-{folder}"
        secret = await self.client.get(SECRETS, namespace, name)
        if secret is not None and not path.exists():
            path.mkdir(parents=True)
            for key, value in secret.get("data", {}).items():
                target = path / key
                target.write_bytes(base64.b64decode(value))
                target.chmod(0o400)
        return path

    def _start(self, pod: LocalPod) -> None:
        if pod.restarts and pod.log_path is not None and pod.log_path.exists():  # kept for ``kubectl logs -p``
            pod.log_path.replace(self._previous_log(pod.log_path))
        pod.process = pods.start(pod.spec, pod.log_path or Path(os.devnull))
        pod.started_at = now_rfc3339()
        pod.ready = False

    @staticmethod
    def _previous_log(path: Path) -> Path:
        return path.with_suffix(".previous.log")

    def pod_log(self, namespace: str, name: str) -> PodLog | None:
        """Where a pod's container logs are, as a kubelet keeps them (the API's ``pods/{name}/log``)."""
        pod = self.pods.get((namespace, name))
        if pod is None or pod.log_path is None:
            return None
        previous = self._previous_log(pod.log_path)
        process = pod.process
        return PodLog(
            pod.log_path,
            previous if previous.exists() else None,
            lambda: process is not None and process.poll() is None,
        )

    async def _healthy(self, pod: LocalPod) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        try:
            async with self._session.get(f"{self.http_url(pod.namespace, pod.name)}{pod.spec.health_path}") as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _watch(self, pod: LocalPod) -> None:
        if pod.process is not None and pod.process.poll() is not None:  # the container exited: restart it
            pod.last_state = terminated(pod.process.returncode, pod.started_at)
            pod.restarts += 1
            self._start(pod)
            await self._report(pod)
            return
        if not pod.ready and await self._healthy(pod):
            pod.ready = True
            await self._report(pod)

    async def _report(self, pod: LocalPod) -> None:
        status = {
            "phase": "Running",
            "podIP": pod.ip,
            "conditions": [{"type": "Ready", "status": "True" if pod.ready else "False"}],
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": pod.ready,
                    "restartCount": pod.restarts,
                    "image": "local",
                    "imageID": "",
                    "started": True,
                    "state": {"running": {"startedAt": pod.started_at}},
                    **({"lastState": {"terminated": pod.last_state}} if pod.last_state else {}),
                }
            ],
        }
        await self.client.patch(PODS, pod.namespace, pod.name, {"status": status}, "status")

    def log_tails(self, lines: int = 40) -> str:
        """The last lines each pod's containers printed (both incarnations of a restarted pod), for a failure
        report: the pods' folder is removed when the demo ends."""
        parts = []
        for pod in self.pods.values():
            if pod.log_path is None or not pod.log_path.exists():
                continue
            previous = self._previous_log(pod.log_path)
            text = (previous.read_text(errors="replace") if previous.exists() else "") + pod.log_path.read_text(
                errors="replace"
            )
            tail = text.splitlines()[-lines:]
            parts.append(f"--- {pod.name} (restarts: {pod.restarts}), last {len(tail)} lines of its log ---")
            parts.extend(tail)
        return "\n".join(parts)

    def http_url(self, namespace: str, name: str) -> str:
        pod = self.pods[(namespace, name)]
        return f"http://{pod.ip}:{pod.spec.http_port}"


def terminated(returncode: int, started_at: str) -> Obj:
    """A container that ended, as a kubelet reports it (``containerStatuses[].lastState.terminated``): the exit code
    (128 + the signal's number for a process a signal ended, as a container runtime reports it) and why."""
    code = 128 - returncode if returncode < 0 else returncode
    reason = "Completed" if code == 0 else "Error"
    return {"exitCode": code, "reason": reason, "startedAt": started_at, "finishedAt": now_rfc3339()}


#: the engine environment variable naming the router's token file (the agent core's contract)
TOKEN_ENV = PREFIX + "TRANSFER_TOKEN_FILE"


async def router_token(client: KubeClient, namespace: str, deployment: str) -> bytes:
    """The deployment's router token (spec.router.signTransfers), as its Secret holds it; the operator creates the
    Secret before the workloads that mount it."""
    secret = await client.get(SECRETS, namespace, router_token_secret_name(deployment))
    if secret is None:
        raise RuntimeError(f"the Secret {router_token_secret_name(deployment)} is missing")
    return base64.b64decode(secret["data"][TOKEN_KEY]).strip()
