"""Issue 59: `kvbridge demo -f` refuses, before it starts anything, a manifest its local cluster cannot run (GPUs, a
model from a hub, engines spanning nodes, more TP ranks than cores, devices in a template overlay), naming each
field and what to run instead; it used to start the pods and wait while they crash-looped."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_operator.api.spec import parse_deployment
from kvbridge_sim.demo import documents
from kvbridge_sim.demo_preflight import DEMO_NOT_LOCAL, NotLocalError, local_models, local_problems

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
GPU_EXAMPLE = ROOT / "examples" / "vllm" / "llama3-8b-hetero-tp.yaml"
TINY = ROOT / "examples" / "vllm" / "tiny-cpu.yaml"


def fields(document: dict[str, Any], cores: int = 64) -> list[str]:
    problems = local_problems(parse_deployment(document), cores, local_models())
    assert all(p.code == DEMO_NOT_LOCAL for p in problems)
    return [p.field for p in problems]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_for_gpus_is_refused_and_every_cpu_one_runs(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        if not document or document.get("kind") != "DisaggregatedDeployment":
            continue
        engine = document["spec"].get("engine") or {}
        on_gpus = engine.get("kind", "VLLM") == "VLLM" and engine.get("device", "GPU") == "GPU"
        found = fields(document)
        assert ("spec.engine.device" in found) == on_gpus, found
        if not on_gpus:
            assert found == []


def test_the_gpu_example_names_each_field_and_what_to_run_instead() -> None:
    with pytest.raises(NotLocalError) as refused:
        documents([str(GPU_EXAMPLE)], num_layers=4)
    message = refused.value.message
    assert refused.value.code == DEMO_NOT_LOCAL
    assert refused.value.field == "spec.engine.device"
    assert "spec.engine.device: GPU (the default): its pods request nvidia.com/gpu" in message
    assert "--gpu-memory-utilization=0.9" in message  # its GPU-only flag named
    assert "spec.model.name: meta-llama/Llama-3.1-8B-Instruct: no model hub is reached here" in message
    assert f"`kvbridge plan -f {GPU_EXAMPLE}`" in message
    assert "kvbridge demo -f examples/vllm/tiny-cpu.yaml" in message


def test_more_tp_ranks_than_cores_engines_spanning_nodes_and_devices_in_an_overlay_are_refused() -> None:
    tiny = yaml.safe_load(TINY.read_text())
    assert fields(tiny, cores=1) == []
    wide = copy.deepcopy(tiny)
    wide["spec"]["prefill"]["tensorParallelSize"] = 2
    assert fields(wide, cores=2) == []
    assert fields(wide, cores=1) == ["spec.prefill.tensorParallelSize"]
    spanning = copy.deepcopy(tiny)
    spanning["spec"]["engine"]["device"] = "GPU"
    spanning["spec"]["decode"]["nodes"] = 2
    spanning["spec"]["decode"]["tensorParallelSize"] = 2
    assert fields(spanning) == ["spec.engine.device", "spec.decode.nodes"]
    device = copy.deepcopy(tiny)
    container = {"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "4Gi"}}}
    device["spec"]["decode"]["template"] = {"spec": {"containers": [container]}}
    assert fields(device) == ["spec.decode.template.spec.containers[0].resources.limits"]


@pytest.mark.parametrize("serve", [False, True], ids=["run", "serve"])
def test_the_demo_exits_at_once_before_starting_anything(serve: bool) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "demo", "-f", str(GPU_EXAMPLE), *(["--serve"] if serve else [])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 60
    assert "spec.engine.device" in done.stderr
    assert f"kvbridge plan -f {GPU_EXAMPLE}" in done.stderr
    assert "applied" not in done.stderr  # nothing was started
    assert "emulated Kubernetes API" not in done.stderr
    assert done.stdout == ""
