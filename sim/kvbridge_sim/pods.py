"""A rendered pod's engine container as a local process — what a kubelet would run, on this machine.

One function turns the ``engine`` container of a pod template (exactly what the operator renders) into an
argument vector and an environment: the downward API is resolved, the pod's own loopback address stands in
for its network namespace, and the model name may be mapped to a local folder (no hub here). One thing a cluster
has is missing here, its DNS: a decode told its prefill Service (``KVBRIDGE_PREFILL_SERVICE``) is told the network
its pods' addresses are in instead (:func:`local_network`). Nothing else is changed, so what runs is what a cluster
would run. Used by the demo's local runner and by the real-vLLM tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbridge_operator.api.names import ENGINE_CONTAINER
from kvbridge_operator.api.objects import Obj

#: where the project's own executables (kvbridge-agent, vllm) are: the environment this process runs in
BIN_DIR = str(Path(sys.executable).parent)
#: vLLM's flag for the names a server answers to (``model`` of requests, ``/v1/models``)
SERVED_MODEL_NAME = "--served-model-name"


class PodStartError(Exception):
    pass


@dataclass(frozen=True)
class LocalPodSpec:
    """What to run for one pod, and with which environment and cores."""

    argv: list[str]
    env: dict[str, str]
    #: the container's own files: temporary files, caches, the working directory
    workdir: Path
    #: CPU ids the process may use (the kubelet's cpuset); empty: all
    cpus: tuple[int, ...] = ()
    http_port: int = 8000
    health_path: str = "/healthz"


def engine_container(template: Obj) -> Obj:
    """The ``engine`` container of a pod template."""
    for container in template["spec"]["containers"]:
        if container["name"] == ENGINE_CONTAINER:
            found: Obj = container
            return found
    raise PodStartError(f"the pod template has no {ENGINE_CONTAINER!r} container")


def resolve_env(container: Obj, pod_name: str, ip: str) -> dict[str, str]:
    """The container's environment with the downward API filled in (pod name and IP)."""
    fields = {"metadata.name": pod_name, "status.podIP": ip}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        path = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if path is not None and path not in fields:
            raise PodStartError(f"{item['name']}: the local runner resolves only {sorted(fields)}, not {path}")
        env[item["name"]] = fields[path] if path is not None else str(item.get("value", ""))
    return env


#: where every local pod's address is (each pod has a loopback address of its own)
LOCAL_POD_NETWORK = "127.0.0.0/8"


def local_network(env: dict[str, str]) -> dict[str, str]:
    """``env`` as this machine can serve it: no cluster DNS resolves the prefill Service's name here, so a decode that
    names it checks prefill hosts against the local pods' network (``KVBRIDGE_PREFILL_HOSTS``) instead."""
    if env.pop("KVBRIDGE_PREFILL_SERVICE", None) is not None:
        env.setdefault("KVBRIDGE_PREFILL_HOSTS", LOCAL_POD_NETWORK)
    return env


def cpu_request(container: Obj) -> int:
    """Whole cores the container requests (at least 1)."""
    raw = str(container.get("resources", {}).get("requests", {}).get("cpu", "1"))
    cores = float(raw[:-1]) / 1000 if raw.endswith("m") else float(raw)
    return max(1, int(cores + 0.999))


def local_pod(
    template: Obj,
    pod_name: str,
    ip: str,
    workdir: Path,
    *,
    models: Mapping[str, str] | None = None,
    cpus: Sequence[int] = (),
    env_overrides: Mapping[str, str] | None = None,
) -> LocalPodSpec:
    """The local process for a pod's engine container.

    ``models`` maps a model name in the arguments to a local folder. vLLM containers bind the pod's address
    (``--host``: a pod's network namespace has its own 0.0.0.0; on one machine each pod has a loopback address).
    """
    container = engine_container(template)
    argv = [*container.get("command", []), *container.get("args", [])]
    if not argv:
        raise PodStartError("the engine container has no command")
    argv = local_argv(argv, models or {}, ip)
    env = local_network(resolve_env(container, pod_name, ip))
    env.update(env_overrides or {})
    http = next((p for p in container.get("ports", []) if p.get("name") in ("http", "vllm")), None)
    probe = container.get("readinessProbe", {}).get("httpGet", {})
    return LocalPodSpec(
        argv=argv,
        env=env,
        workdir=workdir,
        cpus=tuple(cpus),
        http_port=int(http["containerPort"]) if http else 8000,
        health_path=str(probe.get("path", "/healthz")),
    )


def local_argv(argv: Sequence[str], models: Mapping[str, str], ip: str) -> list[str]:
    """A container's command line as a local process runs it: model names mapped to local folders; a vLLM server
    binds the pod's own address (``--host``: on one machine each pod has a loopback address of its own) and serves
    the model under its name only, as on a cluster (``/v1/models`` lists that name, never the local folder). A
    name the command already serves (``--served-model-name``) stays a name."""
    is_vllm = "vllm" in argv and list(argv[argv.index("vllm") + 1 : argv.index("vllm") + 2]) == ["serve"]
    served = argv.index(SERVED_MODEL_NAME) + 1 if SERVED_MODEL_NAME in argv else -1
    mapped = [arg for index, arg in enumerate(argv) if arg in models and index != served]
    local = [arg if index == served else models.get(arg, arg) for index, arg in enumerate(argv)]
    if is_vllm:
        local += ["--host", ip]
        names_given = served >= 0 or any(arg.startswith(f"{SERVED_MODEL_NAME}=") for arg in argv)
        if mapped and not names_given:
            local += [SERVED_MODEL_NAME, mapped[0]]
    return local


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this process when its starter dies, even if it is SIGKILLed (no orphaned engines)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(spec: LocalPodSpec, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the pod's process in its own session (so :func:`stop` can end every process it spawns)."""
    workdir = spec.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    environ = {
        **os.environ,
        # the container's private temporary files and caches (vLLM leaves sockets and compiled code there)
        "TMPDIR": str(workdir),
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
        "HF_HUB_OFFLINE": "1",
        **spec.env,
        "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cpus = set(spec.cpus)

    def prepare() -> None:  # pragma: no cover - runs in the child between fork and exec
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child from here on
    try:
        return subprocess.Popen(
            spec.argv,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=prepare,
            cwd=workdir,
        )
    finally:
        log.close()


def stop(process: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the pod's whole process group, wait at most ``grace`` seconds for every process in it to exit, SIGKILL
    what is left, and reap it.

    Every process, not only the leader: vLLM's API server exits first, while its engine core, workers and
    multiprocessing's resource tracker are still unlinking their shared memory (``/dev/shm``). Killed then, they left
    it behind: eight files per stopped TP-2 engine, on a machine that runs many.
    """
    deadline = time.monotonic() + max(grace, 0.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(grace, 0.0))
    _wait_group(process.pid, deadline)
    # what is still running after the grace period (a stuck worker) is killed, leader or not
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    _wait_group(process.pid, time.monotonic() + 10)


def terminate(process: subprocess.Popen[bytes], grace: float) -> None:
    """What a kubelet does to a container: SIGTERM its main process only (it shuts down its own children), wait
    at most ``grace`` seconds for it to exit, then SIGKILL everything left (a container's end takes every process
    in it).

    One difference: on a node the container's ``/dev/shm`` goes with it, here it is the machine's. So the processes
    left when the main one exits get what is left of the grace period to exit (and unlink their shared memory) before
    they are killed; no signal reaches them before that.
    """
    deadline = time.monotonic() + max(grace, 0.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=max(grace, 0.0))
    _wait_group(process.pid, deadline)
    stop(process, grace=0.0)


def _wait_group(pgid: int, deadline: float) -> None:
    """Until no process of the group is left (its leader reaped) or the deadline passes."""
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
