"""``kvbridge demo``: the whole system on one machine, no cluster.

An emulated Kubernetes API, the operator, a local pod runner (a stand-in for
the StatefulSet controller and kubelet), two example deployments (one
compatible, one incompatible), and real KV transfers through the published
endpoints — including across a prefill pod restart. By default the pods run
real vLLM (its CPU build, a tiny model made locally) and decode's greedy
tokens are checked against a single engine; ``--engine synthetic`` (formerly
``agent``, still read) runs kvbridge's synthetic engine instead and checks
every byte. A manifest the
local runner cannot run is refused before anything starts (demo_preflight);
the wait for readiness reports crash-looping pods (demo_wait), the requests
are demo_traffic's, the report demo_report's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge_operator.api.names import LABEL_DEPLOYMENT
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import EngineSpec
from kvbridge_operator.children.engines import ENGINES
from kvbridge_operator.cli.manifests import deployments_of, parse_documents, read_text, source_name
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.kube import DEPLOYMENTS, PODS, KubeClient
from kvbridge_sim.demo_preflight import refuse_unrunnable
from kvbridge_sim.demo_report import conditions_of, entry_of, events_of, ready_columns
from kvbridge_sim.demo_traffic import route, route_vllm
from kvbridge_sim.demo_wait import NAMESPACE, condition, progress, wait_for_verdicts

#: the demo's own manifests (package data: byte copies of examples/vllm/tiny-cpu.yaml and examples/synthetic/*.yaml,
#: kept equal by a test), so the demo runs wherever kvbridge_sim is installed, not only from a checkout
MANIFESTS = Path(__file__).resolve().parent / "manifests"
DEFAULT_FILES = {
    "vllm": ("tiny-cpu.yaml", "incompatible-replicated-heads.yaml"),
    "synthetic": ("llama3-8b-hetero-tp.yaml", "incompatible-replicated-heads.yaml"),
}
#: ``--engine``'s former names, still read as the one they name (the synthetic engine was the agent engine)
FORMER_ENGINES = {"agent": "synthetic"}


def serves_model(document: Obj) -> bool:
    """Whether the document's engines serve its model (vLLM, the default kind; the synthetic engine serves none):
    the engine kind's ``serves_model``, the kind read as the API reads it (its default, its former names)."""
    kind = ((document.get("spec") or {}).get("engine") or {}).get("kind")
    return ENGINES[EngineSpec.model_validate({} if kind is None else {"kind": kind}).kind].serves_model


def documents(files: list[str] | None, num_layers: int, engine: str = "vllm") -> list[Obj]:
    """The manifests to apply (by default ``engine``'s, a key of :data:`DEFAULT_FILES` or a former name); models of
    engines that serve none (the synthetic engine's) scaled down to ``num_layers`` so the demo fits this machine
    (vLLM engines serve a real model, whose geometry the spec must state as it is). A manifest the local runner
    cannot run is refused here, before anything starts (demo_preflight.NotLocalError)."""
    paths = files or [str(MANIFESTS / name) for name in DEFAULT_FILES[FORMER_ENGINES.get(engine, engine)]]
    found: list[Obj] = []
    for path in paths:
        source = source_name(path)
        parsed = parse_documents(read_text(path), source)  # read once: stdin cannot be read twice
        # the same validation as `kvbridge plan`: valid documents only; then what this machine can run
        refuse_unrunnable(deployments_of(parsed, source), path)
        for document in parsed:
            if document:
                scaled = copy.deepcopy(document)
                if not serves_model(scaled):
                    model = scaled["spec"]["model"]
                    model["numLayers"] = min(int(model["numLayers"]), num_layers)
                found.append(scaled)
    return found


def synthetic_deployment(name: str) -> Obj:
    """2 prefill + 2 decode synthetic-engine pods on CPU (a small model, a 20 s lease, a 5 s drain): the
    deployment the day-2 test and benchmarks/chaos_under_load.py run operations on under load."""
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": name},
        "spec": {
            "engine": {"kind": "Synthetic", "device": "CPU"},
            "model": {"name": "m", "numLayers": 2, "numKVHeads": 4, "headDim": 64},
            "transfer": {"leaseSeconds": 20, "drainSeconds": 5},
            "prefill": {"replicas": 2, "blockSize": 16},
            "decode": {"replicas": 2, "blockSize": 16},
        },
    }


def models_for(docs: list[Obj], workdir: Path) -> dict[str, str]:
    """The local model folder for each model name the vLLM documents serve (the tiny model, and the small one
    where a document names it: made here)."""
    if not any(serves_model(d) for d in docs):
        return {}
    from kvbridge_sim import tiny_model

    named = {str(((d.get("spec") or {}).get("model") or {}).get("name", "")) for d in docs if serves_model(d)}
    folders = {}
    for shape in (s for s in tiny_model.SHAPES.values() if s is tiny_model.TINY or s.name in named):
        progress(f"making {shape.name} (random weights, a tokenizer trained here) ...")
        folders[shape.name] = str(tiny_model.make(workdir / shape.name.split("/")[-1], shape))
    return folders


@dataclass
class LocalCluster:
    """The emulated API, its client and the local kubelet (the operator runs beside them)."""

    api: Any
    url: str
    client: KubeClient
    runner: Any


@contextlib.asynccontextmanager
async def local_cluster(
    workdir: Path, models: dict[str, str], interrupted: asyncio.Event | None
) -> AsyncIterator[LocalCluster]:
    """The emulated API, the operator (in this process) and the local kubelet, started in that order; on exit the
    pods end first (engines drain on SIGTERM), then the operator (Kopf's exit cancels what still runs).
    ``interrupted`` is set on SIGINT/SIGTERM (after the operator started: Kopf installs its own handlers)."""
    from kvbridge_operator.controller.handlers import run_operator
    from kvbridge_sim.local_api import emulated_api, stop_operator_beside
    from kvbridge_sim.runner import LocalRunner

    async with emulated_api() as (api, url, client):
        # every pod is a local process on its own 127.A.B.N: decode reaches prefill's side channels there only
        config = OperatorConfig(
            api_server=url, cpu_mode=True, synthetic_num_blocks=96, liveness_port=0, pod_networks=("127.0.0.0/8",)
        )
        stop, ready = asyncio.Event(), asyncio.Event()
        operator = asyncio.create_task(run_operator(config, stop, ready_flag=ready))
        await asyncio.wait_for(ready.wait(), timeout=60)
        await asyncio.sleep(0.2)  # Kopf installs its own SIGINT/SIGTERM handlers: ours must win
        if interrupted is not None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, interrupted.set)
        runner, runner_stop = LocalRunner(client, workdir, models=models), asyncio.Event()
        api.pod_logs = runner.pod_log  # kubectl logs reads what the local kubelet keeps
        running = asyncio.create_task(runner.run(runner_stop))
        try:
            yield LocalCluster(api, url, client, runner)
        finally:
            runner_stop.set()
            await running
            await runner.close()
            await stop_operator_beside(url, operator, stop, timeout=30)


async def apply_all(client: KubeClient, docs: list[Obj]) -> list[str]:
    """Create each DisaggregatedDeployment; their names."""
    names = []
    for doc in docs:
        await client.create(DEPLOYMENTS, NAMESPACE, doc)
        names.append(doc["metadata"]["name"])
        progress(f"applied DisaggregatedDeployment {doc['metadata']['name']}")
    return names


async def run_demo(
    files: list[str] | None,
    requests: int,
    num_layers: int,
    interrupted: asyncio.Event | None = None,
    engine: str = "vllm",
) -> dict[str, Any]:
    docs = documents(files, num_layers, engine)
    vllm_docs = [d for d in docs if serves_model(d)]
    progress(
        "kvbridge demo — everything on this machine: an emulated Kubernetes API, the operator, and a local "
        "stand-in for the StatefulSet controller and kubelet (pods are local processes on 127.A.B.N; not a "
        "cluster). "
        + (
            "vLLM pods run vLLM's CPU build with a tiny model made locally; starting them takes a minute or two."
            if vllm_docs
            else f"Models scaled to at most {num_layers} layers."
        )
    )
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as workdir:
        models = models_for(docs, Path(workdir))
        async with local_cluster(Path(workdir), models, interrupted) as cluster:
            try:
                names = await apply_all(cluster.client, docs)
                objects = await wait_for_verdicts(
                    cluster.client, names, 900 if vllm_docs else 150, interrupted, logs=cluster.runner.pod_log
                )
                report: dict[str, Any] = {"ok": True, "deployments": [], "events": []}
                for name in names:
                    entry, ok = await _exercise(cluster, objects[name], requests, interrupted)
                    report["ok"] &= ok
                    report["deployments"].append(entry)
                    report["events"] += events_of(cluster.api, name)
                restarted = any(e["reason"] == "PrefillRestarted" for e in report["events"])
                report["ok"] &= restarted or not any(
                    d.get("transfers", {}).get("verifiedAfterPrefillRestart") for d in report["deployments"]
                )
                if not report["ok"]:
                    progress(cluster.runner.log_tails())
                return report
            except BaseException:
                progress(cluster.runner.log_tails())
                raise


async def _exercise(
    cluster: LocalCluster, obj: Obj, requests: int, interrupted: asyncio.Event | None
) -> tuple[dict[str, Any], bool]:
    """One settled deployment's report entry, and whether it did what it should: a compatible one serves every
    request through its router (a prefill restart halfway) and is Ready at the end; an incompatible one has no
    pods and says why."""
    client, name = cluster.client, obj["metadata"]["name"]
    entry = entry_of(obj)
    if condition(obj, "Compatible").get("status") != "True":
        pods = await client.list(PODS, NAMESPACE, f"{LABEL_DEPLOYMENT}={name}")
        entry["pods"] = len(pods)
        return entry, not pods and condition(obj, "Compatible").get("reason") == "Incompatible"
    progress(f"routing {requests} requests through {name} ...")
    if serves_model(obj):
        model = obj["spec"]["model"]["name"]  # the served name, as clients of a cluster send
        transfers = await route_vllm(client, cluster.runner, name, requests, model, interrupted)
    else:
        transfers = await route(client, cluster.runner, name, requests, True, interrupted)
    await asyncio.sleep(1.0)  # let the operator publish the last pod events
    entry["transfers"] = transfers.to_dict()
    final = await client.get(DEPLOYMENTS, NAMESPACE, name) or obj
    entry["conditions"] = conditions_of(final)
    entry["endpoints"] = final["status"]["prefill"].get("endpoints") or []
    entry["ready"] = ready_columns(final)
    ok = (
        transfers.verified == transfers.requests
        and (transfers.after_restart > 0 or not transfers.restarted)
        and entry["conditions"].get("Ready") == "True"
    )
    return entry, ok
