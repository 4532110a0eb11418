"""A local stand-in for the StatefulSet controller and the kubelet — on this machine, not a cluster.

For every StatefulSet the operator created it creates the pods, gives each
its own loopback address (127.0.0.N, so every pod can bind the real ports),
mounts the side-channel Secret as files, resolves the downward-API
variables, starts the container as a local ``kvbridge-agent serve`` process,
reports readiness (``/healthz``), IP and restarts into pod status, restarts
a process that exits (as a kubelet would), and stops everything on close.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import ctypes
import itertools
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ..kube import PODS, SECRETS, STATEFUL_SETS, KubeClient
from ..render import MANAGED_BY, secret_name

Obj = dict[str, Any]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this process when the demo dies, even if it is SIGKILLed (no orphaned engines)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class LocalPod:
    namespace: str
    name: str
    deployment: str
    ip: str
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    log_path: Path | None = None


class LocalRunner:
    def __init__(self, client: KubeClient, workdir: Path) -> None:
        self.client = client
        self.workdir = workdir
        self.pods: dict[tuple[str, str], LocalPod] = {}
        self._addresses = itertools.count(2)
        self._session: aiohttp.ClientSession | None = None

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
        for pod in self.pods.values():
            self._terminate(pod)
        for pod in self.pods.values():
            if pod.process is not None:
                try:
                    pod.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pod.process.kill()
                    pod.process.wait(timeout=10)
        if self._session is not None:
            await self._session.close()

    @staticmethod
    def _terminate(pod: LocalPod) -> None:
        if pod.process is not None and pod.process.poll() is None:
            pod.process.send_signal(signal.SIGTERM)

    def crash(self, namespace: str, name: str) -> None:
        """Kill a pod's engine at once (and its ranks, which exit when their pipe closes)."""
        pod = self.pods[(namespace, name)]
        if pod.process is not None and pod.process.poll() is None:
            pod.process.kill()

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.pods.values() if p.process is not None]

    # -- reconciling pods -------------------------------------------------------------
    async def sync(self) -> None:
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        for sts in await self.client.list(STATEFUL_SETS, None, selector):
            namespace, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
            for index in range(int(sts["spec"].get("replicas", 0))):
                key = (namespace, f"{name}-{index}")
                if key not in self.pods:
                    await self._create(sts, key[1])
        for pod in list(self.pods.values()):
            await self._watch(pod)

    async def _create(self, sts: Obj, pod_name: str) -> None:
        namespace = sts["metadata"]["namespace"]
        template = copy.deepcopy(sts["spec"]["template"])
        labels = template["metadata"].get("labels", {})
        deployment = labels.get("kvbridge.io/deployment", "")
        ip = f"127.0.0.{next(self._addresses)}"
        keys_dir = await self._mount_keys(namespace, deployment)
        container = template["spec"]["containers"][0]
        env: dict[str, str] = {}
        for item in container.get("env", []):
            field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            env[item["name"]] = pod_name if field == "metadata.name" else ip if field == "status.podIP" else str(
                item.get("value", ""))  # fmt: skip
        env.update(KVBRIDGE_KEYS_DIR=str(keys_dir), KVBRIDGE_HTTP_HOST=ip)
        owner = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"],
                 "uid": sts["metadata"]["uid"], "controller": True}  # fmt: skip
        pod_obj = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
                   "metadata": {**template["metadata"], "name": pod_name, "ownerReferences": [owner]}}  # fmt: skip
        await self.client.create(PODS, namespace, pod_obj)
        pod = LocalPod(namespace, pod_name, deployment, ip, env, log_path=self.workdir / f"{pod_name}.log")
        self.pods[(namespace, pod_name)] = pod
        self._start(pod)
        await self._report(pod)

    async def _mount_keys(self, namespace: str, deployment: str) -> Path:
        path = self.workdir / f"{namespace}-{deployment}-keys"
        secret = await self.client.get(SECRETS, namespace, secret_name(deployment))
        if secret is not None and not path.exists():
            path.mkdir(parents=True)
            for key, value in secret.get("data", {}).items():
                target = path / key
                target.write_bytes(base64.b64decode(value))
                target.chmod(0o400)
        return path

    def _start(self, pod: LocalPod) -> None:
        environ = {**os.environ, **pod.env}
        log = open(pod.log_path or os.devnull, "ab")  # noqa: SIM115 - owned by the child from here on
        pod.process = subprocess.Popen(
            [sys.executable, "-m", "kvbridge_agent", "serve"], env=environ, stdout=subprocess.DEVNULL,
            stderr=log, start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()
        pod.ready = False

    async def _healthy(self, pod: LocalPod) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        port = pod.env.get("KVBRIDGE_HTTP_PORT", "8000")
        try:
            async with self._session.get(f"http://{pod.ip}:{port}/healthz") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _watch(self, pod: LocalPod) -> None:
        if pod.process is not None and pod.process.poll() is not None:  # the container exited: restart it
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
            "containerStatuses": [{"name": "engine", "ready": pod.ready, "restartCount": pod.restarts,
                                   "image": "local", "imageID": "", "started": True}],
        }  # fmt: skip
        await self.client.patch(PODS, pod.namespace, pod.name, {"status": status}, "status")

    def http_url(self, namespace: str, name: str) -> str:
        pod = self.pods[(namespace, name)]
        return f"http://{pod.ip}:{pod.env.get('KVBRIDGE_HTTP_PORT', '8000')}"
