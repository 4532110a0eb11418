"""Real ``vllm serve`` processes (vLLM's CPU build) started from exactly what the operator renders.

A DisaggregatedDeployment for the tiny local model is rendered by the operator's own code
(``render.stateful_set``); each role's engine container runs as a local process through the same function
the demo's runner uses, with only the host (each pod its own loopback address), the model path and the cores
(a kubelet's cpuset) substituted. Or an engine is started from ``kvbridge plan --json`` alone (plan_json_pod),
with the same substitutions: the proof that the JSON is enough to run a role outside Kubernetes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig
from kvbridge_sim import pods, tiny_model
from kvbridge_sim.support import wait_until

MODEL_NAME = tiny_model.NAME  # what spec.model.name says; mapped to the local folder when started
VLLM = Path(sys.executable).parent / "vllm"
START_TIMEOUT = 600.0  # seconds for every engine to answer /health (about 60 s each here, four at once)
UID = "00000000-0000-0000-0000-00000000e2e0"


def deployment(
    name: str,
    prefill_tp: int,
    *,
    lease: int | None = None,
    extra: tuple[str, ...] = (),
    connector: str = "Nixl",
    blocks: tuple[int, int] = (32, 32),
    device: str = "CPU",
    verification: str | None = None,
    shape: tiny_model.Shape = tiny_model.TINY,
    expert_parallel: bool = False,
) -> dict[str, Any]:
    """A vLLM DisaggregatedDeployment of the tiny model (or another local ``shape``), on CPUs (vLLM's CPU build)
    unless ``device`` says GPU: prefill TP ``prefill_tp`` -> decode TP 1; ``verification`` sets
    spec.transfer.verification; ``expert_parallel`` both roles' expertParallel (a mixture-of-experts shape)."""
    transfer: dict[str, Any] = {} if lease is None else {"leaseSeconds": lease}
    if verification is not None:
        transfer["verification"] = verification
    engine: dict[str, Any] = {"kind": "VLLM", "device": device, "connector": connector}
    if device == "CPU":
        engine["cpuKVCacheGiB"] = 1
    experts = {"expertParallel": True} if expert_parallel else {}
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": name},
        "spec": {
            "engine": {**engine, "extraArgs": ["--enforce-eager", "--max-model-len=512", *extra]},
            "model": {"name": shape.name, **shape.geometry},
            "transfer": transfer,
            "prefill": {"replicas": 1, "tensorParallelSize": prefill_tp, "blockSize": blocks[0], **experts},
            "decode": {"replicas": 1, "tensorParallelSize": 1, "blockSize": blocks[1], **experts},
        },
    }


def plan_json(document: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """``kvbridge plan --json`` of one deployment, run as a user runs it (the installed command, a manifest file)."""
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = workdir / f"{document['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(document))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "kvbridge"), "plan", "-f", str(manifest), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"kvbridge plan --json failed ({done.returncode}): {done.stderr}")
    entries = json.loads(done.stdout)
    entry: dict[str, Any] = entries[0] if isinstance(entries, list) else entries
    return entry


def plan_json_pod(
    entry: dict[str, Any],
    role: Role,
    pod_name: str,
    ip: str,
    workdir: Path,
    *,
    models: dict[str, str],
    cpus: tuple[int, ...] = (),
    env_overrides: dict[str, str] | None = None,
) -> pods.LocalPodSpec:
    """A role's engine process from ``kvbridge plan --json`` alone: its ``command`` and ``environment``, with only
    what a pod gets from elsewhere filled in — the downward API's ``<metadata.name>`` and ``<status.podIP>``, the
    model folder for the model name, ``--host`` (each pod its own address), the keys folder (the Secret's
    mount), the cores (a kubelet's cpuset) and, for want of cluster DNS, the local pods' network for the prefill
    Service (pods.local_network)."""
    engine = entry["vllm"][role.value.lower()]
    fields = {"<metadata.name>": pod_name, "<status.podIP>": ip}
    env: dict[str, str] = {}
    for name, value in engine["environment"].items():
        if value.startswith("<") and value.endswith(">"):
            if value not in fields:
                raise AssertionError(f"{name}={value}: the JSON names a source this runner cannot fill")
            value = fields[value]
        env[name] = value
    env = pods.local_network(env)
    env.update(env_overrides or {})
    argv = pods.local_argv(engine["command"], models, ip)
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
    return pods.LocalPodSpec(
        argv=argv, env=env, workdir=workdir, cpus=tuple(cpus), http_port=port, health_path="/health"
    )


def rendered_template(document: dict[str, Any], role: Role) -> dict[str, Any]:
    dd = parse_deployment(document)
    plan = verdict_for(dd)
    if not isinstance(plan, TransferPlan):
        raise AssertionError(f"{dd.metadata.name} is not compatible: {plan}")
    template: dict[str, Any] = stateful_set(dd, UID, role, plan, OperatorConfig())["spec"]["template"]
    return template


@dataclass
class Engine:
    name: str
    ip: str
    spec: pods.LocalPodSpec
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.spec.http_port}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class Engines:
    """Every engine of the session, started together and stopped together."""

    workdir: Path
    model: Path
    engines: dict[str, Engine] = field(default_factory=dict)
    #: other local models by ``spec.model.name`` (the tiny model's folder is ``model``)
    more_models: dict[str, Path] = field(default_factory=dict)
    keys_dir: Path | None = None
    peak_rss: int = 0
    start_seconds: dict[str, float] = field(default_factory=dict)
    _sampling: threading.Event = field(default_factory=threading.Event)
    _sampler_started: bool = False

    def add(
        self, name: str, template: dict[str, Any], ip: str, cpus: tuple[int, ...], env: dict[str, str] | None = None
    ) -> Engine:
        spec = pods.local_pod(template, name, ip, self.workdir / name, models=self.models, cpus=cpus, env_overrides=env)
        engine = Engine(name, ip, spec, self.workdir / f"{name}.log")
        self.engines[name] = engine
        return engine

    @property
    def models(self) -> dict[str, str]:
        """Every local model's folder by ``spec.model.name``, as the pods' runner maps them."""
        return {MODEL_NAME: str(self.model), **{name: str(path) for name, path in self.more_models.items()}}

    def add_spec(self, name: str, ip: str, spec: pods.LocalPodSpec) -> Engine:
        """An engine whose process is already described (e.g. from ``kvbridge plan --json``: plan_json_pod)."""
        engine = Engine(name, ip, spec, self.workdir / f"{name}.log")
        self.engines[name] = engine
        return engine

    def start(self, names: list[str]) -> None:
        """Start these engines together and wait until every one answers /health."""
        started = time.monotonic()
        if not self._sampler_started:
            threading.Thread(target=self._sample_memory, daemon=True).start()
            self._sampler_started = True
        for name in names:
            engine = self.engines[name]
            engine.process = pods.start(engine.spec, engine.log)
        waiting = {name: self.engines[name] for name in names}

        def healthy() -> bool:
            for name, engine in list(waiting.items()):
                if engine.process is not None and engine.process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {engine.process.returncode}:\n{engine.log_tail()}")
                if _healthy(engine.url):
                    del waiting[name]
            return not waiting

        wait_until(healthy, START_TIMEOUT, lambda: f"{sorted(waiting)} to be healthy", interval=1.0)
        self.start_seconds[",".join(names)] = round(time.monotonic() - started, 1)

    def stop(self, names: list[str] | None = None) -> None:
        for name in list(self.engines) if names is None else names:
            engine = self.engines[name]
            if engine.process is not None:
                pods.stop(engine.process)
                engine.process = None
        if names is None:
            self._sampling.set()

    def log_tails(self, names: list[str], chars: int = 2500) -> str:
        """What these engines printed last, for a failing assertion's message (the logs go with pytest's tmp)."""
        return "\n".join(
            f"--- {name}'s log, last {chars} characters ---\n{self.engines[name].log_tail(chars)}" for name in names
        )

    def running(self, name: str) -> bool:
        process = self.engines[name].process
        return process is not None and process.poll() is None

    def _sample_memory(self) -> None:
        while not self._sampling.wait(1.0):
            groups = {e.process.pid for e in self.engines.values() if e.process is not None}
            self.peak_rss = max(self.peak_rss, _rss_of_groups(groups))

    def summary(self) -> dict[str, Any]:
        return {"startSeconds": self.start_seconds, "peakRssGiB": round(self.peak_rss / 2**30, 2)}


async def metric(session: Any, url: str, name: str, labels: str = "") -> float:
    """The sum of every sample of ``name`` on an engine's /metrics whose labels contain ``labels`` (0: none)."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and labels in line
    )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


def process_group_stats(groups: set[int]) -> Iterator[list[str]]:
    """``/proc/<pid>/stat`` of every process in the given process groups (an engine and what it spawned), as the
    fields after the command name: index 2 is the group, 11/12 user and system ticks, 21 resident pages."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) in groups:
                yield fields
        except (OSError, IndexError, ValueError):
            continue


def _rss_of_groups(groups: set[int]) -> int:
    """Resident memory of every process in the given process groups."""
    return sum(int(fields[21]) for fields in process_group_stats(groups)) * os.sysconf("SC_PAGE_SIZE")


def vllm_parts(template: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """What vLLM reads of a pod: its command line and its VLLM_* environment."""
    container = pods.engine_container(template)
    env = {e["name"]: json.dumps(e.get("value", e.get("valueFrom"))) for e in container["env"]}
    return [*container["command"], *container["args"]], {k: v for k, v in env.items() if k.startswith("VLLM_")}
