"""What the demo's local cluster can run, checked before it starts anything: a manifest made for a cluster (GPUs,
a model from a hub, engines spanning nodes, more tensor-parallel ranks than this machine has cores) is refused
with each field at fault and what to run instead, rather than its pods crash-looping while the demo waits.

The local runner runs each pod's engine container as a process on this machine: vLLM's CPU build (one core per
TP rank, the CPU launcher binds them), models made locally (:mod:`.tiny_model`), one pod per engine
(StatefulSets; no LeaderWorkerSet groups), no volumes, downloads or extended resources. kvbridge's synthetic
engine (``engine.kind: Synthetic``) runs on any device setting: the operator's CPU mode gives its pods no GPUs.
What each engine kind needs here its module says (``on_cpu`` in the operator's CPU mode, ``serves_model``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from kvbridge_agent.core import KVBridgeError, Problem, Role
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, EngineDevice
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.engines.vllm_serve import argument_name
from kvbridge_operator.config import OperatorConfig

#: the code of a manifest the local cluster cannot run
DEMO_NOT_LOCAL = "DEMO_NOT_LOCAL"
#: a manifest the demo runs locally, named in the refusal
LOCAL_EXAMPLE = "examples/vllm/tiny-cpu.yaml"


class NotLocalError(KVBridgeError):
    """A manifest the demo's local cluster cannot run (each problem's field and why, then what to run instead)."""

    code = DEMO_NOT_LOCAL


def local_cores() -> int:
    """The cores this process may run on: what the local kubelet hands out to pods."""
    return len(os.sched_getaffinity(0))


def local_models() -> tuple[str, ...]:
    """The model names the demo makes locally (random weights, a tokenizer trained here)."""
    from kvbridge_sim.tiny_model import SHAPES

    return tuple(SHAPES)


def local_problems(dd: DisaggregatedDeployment, cores: int, models: tuple[str, ...]) -> list[Problem]:
    """Why the local runner cannot run ``dd`` (empty: it can), each with the field at fault."""
    spec = dd.spec
    found = list(_engine_problems(dd, cores, models))
    for role in Role:
        role_spec = spec.prefill if role is Role.PREFILL else spec.decode
        if role_spec.nodes > 1:
            found.append(
                Problem(
                    DEMO_NOT_LOCAL,
                    f"spec.{role.value}.nodes",
                    f"{role_spec.nodes}: an engine spanning nodes is a LeaderWorkerSet group of pods; the local "
                    "runner runs StatefulSets, one process per pod",
                )
            )
        for where, resource in _extended_resources(role_spec.template):
            found.append(
                Problem(
                    DEMO_NOT_LOCAL,
                    f"spec.{role.value}.template.{where}",
                    f"{resource}: an extended resource (a device) the local runner has none of to give",
                )
            )
    return found


def _engine_problems(dd: DisaggregatedDeployment, cores: int, models: tuple[str, ...]) -> Iterator[Problem]:
    """What the local runner cannot run of an engine kind that needs GPUs even in the operator's CPU mode (vLLM on
    ``device: GPU``) or serves a model (vLLM: the model must be made here, its TP ranks fit this machine's cores)."""
    spec = dd.spec
    kind = engine_of(spec)
    if not kind.on_cpu(spec, OperatorConfig(cpu_mode=True)):
        gpu_args = [a for a in spec.engine.extra_args if any(w in argument_name(a) for w in ("gpu", "cudagraph"))]
        also = f"; its extraArgs are GPU settings too ({', '.join(gpu_args)})" if gpu_args else ""
        yield Problem(
            DEMO_NOT_LOCAL,
            "spec.engine.device",
            f"GPU (the default): its pods request {OperatorConfig().gpu_resource} (one per TP rank) and "
            f"run vLLM's CUDA build; this machine runs vLLM's CPU build only (engine.device: CPU){also}",
        )
    if not kind.serves_model:
        return
    if spec.model.name not in models and not Path(spec.model.name).is_dir():
        yield Problem(
            DEMO_NOT_LOCAL,
            "spec.model.name",
            f"{spec.model.name}: no model hub is reached here; the demo makes {', '.join(models)} locally "
            "(random weights; a folder on this machine works too)",
        )
    if spec.model.source:
        yield Problem(
            DEMO_NOT_LOCAL,
            "spec.model.source",
            f"{spec.model.source}: the local runner downloads nothing and mounts no volumes",
        )
    for role in Role:
        tp = (spec.prefill if role is Role.PREFILL else spec.decode).tensor_parallel_size
        if spec.engine.device is EngineDevice.CPU and tp > cores:
            yield Problem(
                DEMO_NOT_LOCAL,
                f"spec.{role.value}.tensorParallelSize",
                f"{tp}: vLLM's CPU build runs each TP rank on a core of its own, and this machine gives the demo "
                f"{cores}",
            )


def _extended_resources(template: Obj) -> Iterator[tuple[str, str]]:
    """``(where, name)`` of each extended resource (``vendor/name``: a GPU, an RDMA device) a template overlay's
    containers request or limit."""
    containers = (template.get("spec") or {}).get("containers") or []
    for index, container in enumerate(c for c in containers if isinstance(c, dict)):
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            for name in resources.get(kind) or {}:
                if "/" in str(name):
                    yield f"spec.containers[{index}].resources.{kind}", str(name)


def refuse_unrunnable(deployments: list[DisaggregatedDeployment], path: str) -> None:
    """Raise :class:`NotLocalError` naming every problem of the manifest at ``path`` (``-``: stdin) the local runner
    cannot run, and what to run instead."""
    cores, models = local_cores(), local_models()
    lines: list[str] = []
    first: Problem | None = None
    for dd in deployments:
        problems = local_problems(dd, cores, models)
        if problems:
            first = first or problems[0]
            lines.append(f"{dd.metadata.name} ({'stdin' if path == '-' else path}) cannot run on this machine:")
            lines += [f"  {p.field}: {p.message}" for p in problems]
    if first is not None:
        lines.append(
            f"It is made for a cluster: `kvbridge plan -f {path}` shows what each role would run there (and "
            f"`kubectl apply -f {path}` runs it); `kvbridge demo -f {LOCAL_EXAMPLE}` runs a vLLM deployment "
            "locally, `kvbridge demo --engine synthetic` the synthetic engine."
        )
        raise NotLocalError("\n".join(lines), field=first.field)
