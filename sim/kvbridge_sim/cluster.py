"""Run the emulated API server and the operator in-process; play the StatefulSet controller and kubelet."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.rbac import allowed_calls
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.handlers import run_operator
from kvbridge_operator.kube import DEPLOYMENTS, LEADER_WORKER_SETS, PODS, STATEFUL_SETS, ApiError, KubeClient
from kvbridge_sim.apiserver import RealisticKubernetes
from kvbridge_sim.local_api import emulated_api, stop_operator_beside
from kvbridge_sim.support import until


@dataclass
class Cluster:
    api: RealisticKubernetes
    url: str
    client: KubeClient
    config: OperatorConfig
    operator: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    operator_calls: set[tuple[str, str]] = field(default_factory=set)

    async def start_operator(self) -> None:
        self.stop = asyncio.Event()
        self.operator_client = KubeClient.for_url(self.url)
        self.operator = asyncio.create_task(run_operator(self.config, self.stop, self.operator_client))

    async def stop_operator(self) -> None:
        if self.operator is None:
            return
        await stop_operator_beside(self.url, self.operator, self.stop, timeout=30)
        self.operator = None
        await self.operator_client.close()
        self.operator_calls |= self.operator_client.calls
        undeclared = self.operator_calls - allowed_calls()
        if undeclared:
            raise AssertionError(f"the operator called what kvbridge_operator.api.rbac does not declare: {undeclared}")

    async def apply(self, document: Obj, namespace: str = "default") -> Obj:
        return await self.client.create(DEPLOYMENTS, namespace, document)

    async def patch_spec(self, name: str, spec_patch: Obj, namespace: str = "default") -> Obj:
        return await self.client.patch(DEPLOYMENTS, namespace, name, {"spec": spec_patch})

    def deployment(self, name: str, namespace: str = "default") -> Obj:
        found = self.api.find("disaggregateddeployments", namespace, name)
        if found is None:
            raise AssertionError(f"deployment {name} not found")
        return found

    def condition(self, name: str, kind: str, namespace: str = "default") -> Obj:
        status = self.deployment(name, namespace).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})

    def events(self, name: str) -> list[Obj]:
        return [e for e in self.api.objects_of("events") if e.get("involvedObject", {}).get("name") == name]

    def reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.events(name)]

    async def wait(self, predicate: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
        """:func:`~kvbridge_sim.support.until`, with what a check of this cluster may raise before the objects it
        reads exist (a missing deployment, key or condition) counting as "not yet"."""
        await until(
            predicate,
            timeout,
            what or repr(predicate),
            interval=0.05,
            tolerate=(AssertionError, KeyError, StopIteration),
        )

    # -- the StatefulSet controller and the kubelet, played by the test -----------
    async def run_pods(
        self, name: str, role: str, *, ready: bool = True, ip_base: str = "10.0.0.", namespace: str = "default"
    ) -> list[Obj]:
        """Create (or replace) the pods of a role's StatefulSet as it is now, and report their status."""
        sts = await self._stateful_set(name, role, namespace)
        return [
            await self.replace_pod(name, role, index, ready=ready, ip=f"{ip_base}{index + 1}", namespace=namespace)
            for index in range(int(sts["spec"]["replicas"]))
        ]

    async def replace_pod(
        self, name: str, role: str, index: int, *, ready: bool = True, ip: str, namespace: str = "default"
    ) -> Obj:
        """What the StatefulSet controller does for one pod: delete it if it exists, create it from the
        StatefulSet's current template, and report its status."""
        sts = await self._stateful_set(name, role, namespace)
        pod_name = f"{name}-{role}-{index}"
        if await self.client.get(PODS, namespace, pod_name) is not None:
            await self.client.delete(PODS, namespace, pod_name)
        template = copy.deepcopy(sts["spec"]["template"])
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **template["metadata"],
                "name": pod_name,
                "namespace": namespace,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "StatefulSet",
                        "name": sts["metadata"]["name"],
                        "uid": sts["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
        await self.client.create(PODS, namespace, pod)
        return await self.set_pod(pod_name, ready=ready, ip=ip, namespace=namespace)

    async def run_groups(
        self, name: str, role: str, *, ip_base: str = "10.0.2.", namespace: str = "default"
    ) -> list[Obj]:
        """What the LeaderWorkerSet controller (and the kubelet) do for a multi-node role: per group ``i``, a
        leader pod ``<lws>-<i>`` and worker pods ``<lws>-<i>-<j>`` from the two templates, with LWS's labels,
        all Running and ready."""
        lws = await self.client.get(LEADER_WORKER_SETS, namespace, f"{name}-{role}")
        if lws is None:
            raise AssertionError(f"no LeaderWorkerSet {name}-{role}")
        group = lws["spec"]["leaderWorkerTemplate"]
        owner = {
            "apiVersion": lws["apiVersion"],
            "kind": "LeaderWorkerSet",
            "name": lws["metadata"]["name"],
            "uid": lws["metadata"]["uid"],
            "controller": True,
        }
        made = []
        for index in range(int(lws["spec"]["replicas"])):
            for worker in range(int(group["size"])):
                template = copy.deepcopy(group["leaderTemplate"] if worker == 0 else group["workerTemplate"])
                pod_name = f"{lws['metadata']['name']}-{index}" + (f"-{worker}" if worker else "")
                labels = {
                    **template["metadata"].get("labels", {}),
                    "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                    "leaderworkerset.sigs.k8s.io/group-index": str(index),
                    "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
                }
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "spec": template["spec"],
                    "metadata": {
                        **template["metadata"],
                        "labels": labels,
                        "name": pod_name,
                        "namespace": namespace,
                        "ownerReferences": [owner],
                    },
                }
                if await self.client.get(PODS, namespace, pod_name) is not None:
                    await self.client.delete(PODS, namespace, pod_name)
                await self.client.create(PODS, namespace, pod)
                made.append(
                    await self.set_pod(
                        pod_name, ready=True, ip=f"{ip_base}{index * 16 + worker + 1}", namespace=namespace
                    )
                )
        return made

    async def _stateful_set(self, name: str, role: str, namespace: str) -> Obj:
        sts = await self.client.get(STATEFUL_SETS, namespace, f"{name}-{role}")
        if sts is None:
            raise AssertionError(f"no StatefulSet {name}-{role}")
        return sts

    async def set_pod(
        self, pod_name: str, *, ready: bool, ip: str | None, restarts: int = 0, namespace: str = "default"
    ) -> Obj:
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": ready,
                    "restartCount": restarts,
                    "image": "x",
                    "imageID": "",
                    "started": True,
                }
            ],
        }
        return await self.client.patch(PODS, namespace, pod_name, {"status": status}, "status")


TEST_AGENT = "kvbridge-test"


@contextlib.asynccontextmanager
async def cluster(config: OperatorConfig | None = None, *, start: bool = True) -> AsyncIterator[Cluster]:
    async with emulated_api(user_agent=TEST_AGENT) as (api, url, client):  # the test's own requests, told apart
        # every pod is a local process on its own 127.A.B.N: decode reaches prefill's side channels there only
        base = config or OperatorConfig(liveness_port=0, pod_networks=("127.0.0.0/8",))
        built = Cluster(api, url, client, OperatorConfig(**{**base.__dict__, "api_server": url}))
        try:
            if start:
                await built.start_operator()
            yield built
        finally:
            await built.stop_operator()


class StatefulSetController:
    """The stand-in for the StatefulSet controller and the kubelet, through the API: Parallel pod management,
    RollingUpdate with a partition (one pod replaced at a time, highest ordinal first, once the others are
    ready), pods ready one tick after they are created."""

    def __init__(self, c: Cluster, tick: float = 0.03) -> None:
        self.c, self.tick = c, tick
        self.ips = itertools.count(10)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for sts in self.c.api.objects_of("statefulsets"):
                try:
                    await self._step(sts)
                except (ApiError, AssertionError):
                    meta = sts["metadata"]
                    if self.c.api.find("statefulsets", meta["namespace"], meta["name"]) is not None:
                        raise
                    # deleted meanwhile with its pods (the garbage collector): a controller goes on
            await asyncio.sleep(self.tick)

    async def _step(self, sts: Obj) -> None:
        name, namespace = sts["metadata"]["name"], sts["metadata"]["namespace"]
        deployment, role = name.rsplit("-", 1)
        spec = sts["spec"]
        replicas = int(spec["replicas"])
        partition = int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition", 0))
        revision = spec["template"]["metadata"]["labels"].get("kvbridge.io/revision")
        pods = {}
        for pod in self.c.api.objects_of("pods", namespace):
            found = re.fullmatch(re.escape(name) + r"-(\d+)", pod["metadata"]["name"])
            if found:
                pods[int(found.group(1))] = pod
        for ordinal, pod in pods.items():  # the kubelet: a pod created last tick is ready now
            if not _ready(pod) and ordinal < replicas:
                await self.c.set_pod(
                    pod["metadata"]["name"], ready=True, ip=pod["status"].get("podIP"), namespace=namespace
                )
        for ordinal in [o for o in pods if o >= replicas]:
            await self.c.client.delete(PODS, namespace, pods.pop(ordinal)["metadata"]["name"])
        missing = [o for o in range(replicas) if o not in pods]
        for ordinal in missing:  # Parallel: every missing pod at once
            await self.c.replace_pod(
                deployment, role, ordinal, ready=False, ip=f"10.1.0.{next(self.ips)}", namespace=namespace
            )
        if missing:
            return
        stale = sorted(
            (
                o
                for o, p in pods.items()
                if o >= partition and p["metadata"]["labels"].get("kvbridge.io/revision") != revision
            ),
            reverse=True,
        )
        if stale and all(_ready(p) for o, p in pods.items() if o != stale[0]):
            await self.c.replace_pod(
                deployment, role, stale[0], ready=False, ip=f"10.1.0.{next(self.ips)}", namespace=namespace
            )


def _ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
