"""vLLM engines: golden pod templates, every argument and variable, settings vLLM cannot honour, routing sidecar.

Golden files live in tests/operator/golden/; after an intended change of the rendering, rewrite them with
``KVBRIDGE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_vllm.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.desired import desired_children
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.verdict import advisories_for, verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).parents[2]
GOLDEN = Path(__file__).parent / "golden"
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
EXAMPLES = ["llama3-8b-hetero-tp", "deepseek-v2-lite-mla", "qwen-block-size-ratio"]


def document(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "vllm" / f"{name}.yaml").read_text())
    return loaded


def verdict(doc: dict[str, Any]) -> Any:
    return verdict_for(parse_deployment(doc))


def template(doc: dict[str, Any], role: Role, config: OperatorConfig | None = None) -> dict[str, Any]:
    dd = parse_deployment(doc)
    sts = stateful_set(dd, UID, role, verdict_for(dd), config or OperatorConfig())  # type: ignore[arg-type]
    result: dict[str, Any] = sts["spec"]["template"]
    return result


def engine(doc: dict[str, Any], role: Role, config: OperatorConfig | None = None) -> dict[str, Any]:
    containers = template(doc, role, config)["spec"]["containers"]
    engines: list[dict[str, Any]] = [c for c in containers if c["name"] == "engine"]
    [found] = engines
    return found


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_pod_templates_match_the_golden_files(example: str, role: Role) -> None:
    rendered = template(document(example), role)
    path = GOLDEN / f"vllm-{example}-{role.value.lower()}.json"
    if os.environ.get("KVBRIDGE_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(path.read_text()), f"{path.name} differs (see the module docstring)"


@pytest.mark.parametrize("example", EXAMPLES)
def test_children_validate_strictly(example: str) -> None:
    dd = parse_deployment(document(example))
    for obj in desired_children(dd, UID, verdict_for(dd), OperatorConfig()):  # type: ignore[arg-type]
        kubernetes_validate.validate(obj, "1.30", strict=True)
    config = OperatorConfig(routing_sidecar_image="ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0")
    for obj in desired_children(dd, UID, verdict_for(dd), config):  # type: ignore[arg-type]
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_hetero_tp_arguments_environment_and_gpus() -> None:
    doc = document("llama3-8b-hetero-tp")
    fingerprint = verdict(doc).fingerprint
    for role, tp in ((Role.PREFILL, "2"), (Role.DECODE, "1")):
        container = engine(doc, role)
        args = container["args"]
        assert container["command"] == ["vllm", "serve"]
        assert container["image"] == "vllm/vllm-openai:v0.32.0"
        assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
        assert flag(args, "--tensor-parallel-size") == tp
        assert flag(args, "--block-size") == "16"
        assert flag(args, "--port") == "8000"
        assert flag(args, "--dtype") == "bfloat16"
        assert flag(args, "--kv-cache-dtype") == "auto"
        assert flag(args, "--attention-backend") == "FLASH_ATTN"
        assert args[-2:] == ["--max-model-len=8192", "--gpu-memory-utilization=0.9"]  # extraArgs last
        assert json.loads(flag(args, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
            "kv_buffer_device": "cuda",
            "kv_connector_extra_config": {"backends": ["UCX"], "kv_lease_duration": 120},
        }
        variables = env(container)
        assert variables["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert variables["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert variables["VLLM_KV_CACHE_LAYOUT"] == "LBHNC"  # vLLM 0.32's name of HND
        assert "VLLM_ATTENTION_BACKEND" not in variables  # removed in vLLM 0.32
        assert variables["KVBRIDGE_ROLE"] == role.value
        assert variables["KVBRIDGE_FINGERPRINT"] == fingerprint
        assert variables["KVBRIDGE_KEYS_DIR"] == ""  # vLLM's side channel has no CURVE keys to mount
        assert container["resources"]["limits"] == {"nvidia.com/gpu": tp}
        assert container["resources"]["requests"]["nvidia.com/gpu"] == tp
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "side-channel": 5600}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": 8000}
        spec = template(doc, role)["spec"]
        assert {v["name"] for v in spec["volumes"]} == {"dshm"}  # no key Secret for vLLM


def test_mla_renders_flashmla_and_its_block_size_is_checked() -> None:
    """vLLM 0.32's FlashMLA runs only 64-token blocks: kvbridge renders that backend for MLA on GPUs (instead of
    leaving vLLM to pick another one silently) and refuses another block size before scheduling, with the fix."""
    container = engine(document("deepseek-v2-lite-mla"), Role.DECODE)
    assert flag(container["args"], "--attention-backend") == "FLASHMLA"
    assert flag(container["args"], "--block-size") == "64"
    assert "--trust-remote-code" in container["args"]
    doc = document("deepseek-v2-lite-mla")
    doc["spec"]["prefill"]["blockSize"] = doc["spec"]["decode"]["blockSize"] = 16  # the default
    problems = verdict(doc)
    assert codes(problems) == [
        ("VLLM_MLA_BLOCK_SIZE", "spec.prefill.blockSize"),
        ("VLLM_MLA_BLOCK_SIZE", "spec.decode.blockSize"),
    ]
    assert "spec.decode.blockSize: 64" in problems[1].message
    from kvbridge_operator.children.remedy import suggested_fix

    fix = suggested_fix(parse_deployment(doc))
    assert fix is not None
    assert "64" in str(fix)


def test_block_size_ratio_renders_each_side_and_the_decode_permute() -> None:
    doc = document("qwen-block-size-ratio")
    prefill, decode = engine(doc, Role.PREFILL), engine(doc, Role.DECODE)
    assert flag(prefill["args"], "--block-size") == "16"
    assert flag(decode["args"], "--block-size") == "32"  # vLLM reads 2 prefill blocks into each decode block
    assert env(prefill)["VLLM_KV_CACHE_LAYOUT"] == "LBHNC"
    assert env(decode)["VLLM_KV_CACHE_LAYOUT"] == "LBNHC"
    config = json.loads(flag(decode["args"], "--kv-transfer-config"))
    assert config["enable_permute_local_kv"] is True  # a KVTransferConfig field in vLLM 0.32, not extra config
    assert "enable_permute_local_kv" not in flag(prefill["args"], "--kv-transfer-config")


def test_cross_layer_and_fp8_reach_vllm() -> None:
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["model"].update(cacheKind="CrossLayer", kvCacheDtype="fp8_e4m3")
    container = engine(doc, Role.DECODE)
    args = container["args"]
    assert flag(args, "--kv-cache-dtype") == "fp8_e4m3"
    assert "--dtype" not in args
    assert env(container)["VLLM_KV_CACHE_LAYOUT"] == "BHLNC"  # vLLM 0.32: cross-layer blocks are a layout


def codes(result: Any) -> list[tuple[str, str]]:
    assert isinstance(result, list), "expected problems"
    return [(p.code, p.field) for p in result if isinstance(p, Problem)]


def test_prefill_side_conversions_are_refused_for_vllm_only() -> None:
    doc = yaml.safe_load(
        (ROOT / "examples" / "synthetic" / "hetero-block-size.yaml").read_text()
    )  # prefill 32 NHD -> 16 HND
    assert not isinstance(verdict(doc), list)  # the kvbridge agent converts on prefill
    doc["spec"]["engine"] = {"kind": "VLLM"}
    assert ("VLLM_PREFILL_CONVERSION", "spec.prefill.blockSize") in codes(verdict(doc))
    assert ("VLLM_PREFILL_CONVERSION", "spec.prefill.kvLayout") in codes(verdict(doc))


def test_extra_args_may_not_override_what_the_plan_checked() -> None:
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["engine"]["extraArgs"] = ["--block-size=32", "--kv-transfer-config", "{}", "--enforce-eager"]
    assert codes(verdict(doc)) == [("VLLM_MANAGED_ARGUMENT", "spec.engine.extraArgs")] * 2


@pytest.mark.parametrize(
    ("arg", "code"),
    [
        ("--tensor_parallel_size=16", "VLLM_MANAGED_ARGUMENT"),
        ("--block_size=32", "VLLM_MANAGED_ARGUMENT"),
        ("--kv_transfer_config={}", "VLLM_MANAGED_ARGUMENT"),
        ("--attention_backend=TRITON_ATTN", "VLLM_MANAGED_ARGUMENT"),
        ("--pipeline-parallel-size=2", "VLLM_UNMODELLED_ARGUMENT"),
        ("-pp", "VLLM_UNMODELLED_ARGUMENT"),
        ("--data_parallel_size=2", "VLLM_MANAGED_ARGUMENT"),
        ("-dpl", "VLLM_MANAGED_ARGUMENT"),
        ("--data-parallel-start-rank=1", "VLLM_MANAGED_ARGUMENT"),
        ("--enable-expert-parallel", "VLLM_MANAGED_ARGUMENT"),
        ("-ep", "VLLM_MANAGED_ARGUMENT"),
        ("--decode-context-parallel-size=2", "VLLM_UNMODELLED_ARGUMENT"),
        ("--config=/etc/vllm.yaml", "VLLM_UNMODELLED_ARGUMENT"),
    ],
)
def test_extra_args_are_read_the_way_vllm_reads_them(arg: str, code: str) -> None:
    """Issue 13 #9: underscore spellings passed (vLLM accepts them, the later flag wins), and so did parallelism
    kvbridge does not model, while plan said compatible and the GPU request stayed TP. Data and expert parallelism
    are modelled since (issue 37): their flags come from the spec."""
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["engine"]["extraArgs"] = [arg]
    assert codes(verdict(doc)) == [(code, "spec.engine.extraArgs")]


def test_incompatible_and_vllm_problems_are_reported_together() -> None:
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["decode"]["tensorParallelSize"] = 3
    doc["spec"]["engine"]["extraArgs"] = ["--port=9000"]
    found = [code for code, _ in codes(verdict(doc))]
    assert "TP_NOT_DIVISIBLE" in found
    assert "VLLM_MANAGED_ARGUMENT" in found


def test_routing_sidecar_fronts_decode_and_labels_both_roles() -> None:
    config = OperatorConfig(routing_sidecar_image="ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0")
    doc = document("llama3-8b-hetero-tp")
    decode = template(doc, Role.DECODE, config)
    sidecar, vllm = decode["spec"]["containers"]
    assert sidecar["name"] == "routing-sidecar"
    assert sidecar["image"] == "ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0"
    assert sidecar["args"] == ["--port=8000", "--vllm-port=8200", "--connector=nixlv2", "--secure-proxy=false"]
    assert sidecar["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert flag(vllm["args"], "--port") == "8200"
    assert {p["name"]: p["containerPort"] for p in vllm["ports"]} == {"vllm": 8200, "side-channel": 5600}
    assert vllm["readinessProbe"]["httpGet"]["port"] == 8200
    assert decode["metadata"]["labels"]["llm-d.ai/role"] == "decode"
    prefill = template(doc, Role.PREFILL, config)
    assert [c["name"] for c in prefill["spec"]["containers"]] == ["engine"]
    assert prefill["metadata"]["labels"]["llm-d.ai/role"] == "prefill"
    assert flag(prefill["spec"]["containers"][0]["args"], "--port") == "8000"


def test_plan_prints_the_vllm_command_and_environment_of_each_role() -> None:
    path = ROOT / "examples" / "vllm" / "qwen-block-size-ratio.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    [entry] = json.loads(result.stdout)
    rendered = engine(document("qwen-block-size-ratio"), Role.DECODE)
    assert entry["vllm"]["decode"]["command"] == ["vllm", "serve", *rendered["args"]]
    assert entry["vllm"]["decode"]["env"]["VLLM_KV_CACHE_LAYOUT"] == "LBNHC"
    assert entry["vllm"]["decode"]["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "<status.podIP>"
    assert entry["vllm"]["prefill"]["kvTransferConfig"]["kv_connector"] == "NixlConnector"
    text = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    assert "vLLM decode: vllm serve Qwen/Qwen2.5-7B-Instruct" in text
    assert "VLLM_KV_CACHE_LAYOUT=LBNHC" in text


def cpu_document() -> dict[str, Any]:
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["engine"] = {"kind": "VLLM", "device": "CPU", "cpuKVCacheGiB": 2, "extraArgs": ["--enforce-eager"]}
    for role in ("prefill", "decode"):
        doc["spec"][role].update(blockSize=32, kvLayout="HND")
    return doc


def test_cpu_engines_request_cores_not_gpus_and_bind_one_core_set_per_rank() -> None:
    doc = cpu_document()
    assert not isinstance(verdict(doc), list)
    for role, tp in ((Role.PREFILL, 2), (Role.DECODE, 1)):
        container = engine(doc, role)
        assert container["image"] == "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
        assert container["command"][:2] == ["python3", "-c"]  # the core-binding launcher, then vllm serve
        assert container["command"][3:] == [str(tp), "vllm", "serve"]
        resources = container["resources"]
        assert resources["requests"] == resources["limits"] == {"cpu": str(tp), "memory": f"{2 + 4 * tp}Gi"}
        config = json.loads(flag(container["args"], "--kv-transfer-config"))
        assert config["kv_buffer_device"] == "cpu"
        assert flag(container["args"], "--attention-backend") == "CPU_ATTN"
        assert env(container)["VLLM_CPU_KVCACHE_SPACE"] == "2"
        assert env(container)["KVBRIDGE_DEVICE"] == "cpu"


def _launch(
    launcher: str, tp: int, *command: str, without: tuple[str, ...] = (), **options: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``launcher`` (the CPU launcher, or a probe around it) for TP size ``tp`` in front of ``command``, in this
    environment less a binding of the test's own (and ``without``), with a temporary folder of its own, removed after
    (as a container's: the launcher leaves its ``sitecustomize`` there)."""
    dropped = {"VLLM_CPU_OMP_THREADS_BIND", *without}
    environ = {k: v for k, v in os.environ.items() if k not in dropped}
    with tempfile.TemporaryDirectory(prefix="kvbridge-launcher-") as scratch:
        return subprocess.run(
            [sys.executable, "-c", launcher, str(tp), *command],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={**environ, "TMPDIR": scratch},
            **options,
        )


@pytest.mark.parametrize(("cpus", "tp", "bound"), [([0, 1], 2, "0|1"), ([4, 5, 6, 7], 2, "4,5|6,7"), ([3], 1, "3")])
def test_the_cpu_launcher_splits_the_allowed_cores_between_ranks(cpus: list[int], tp: int, bound: str) -> None:
    from kvbridge_operator.children.engines.vllm_cpu import CPU_BIND_LAUNCHER

    fake = f"import os; os.sched_getaffinity = lambda pid: set({cpus!r}); "
    probe = fake + f"exec(compile({CPU_BIND_LAUNCHER!r}, 'l', 'exec'))"
    result = _launch(probe, tp, sys.executable, "-c", "import os; print(os.environ['VLLM_CPU_OMP_THREADS_BIND'])")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == bound
    assert "kvbridge:" not in result.stderr  # the AMX request is silent on every CPU where nothing fails


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for the container, one outside it")
def test_the_cpu_launcher_keeps_vllm_affinity_changes_on_the_containers_cores() -> None:
    """vLLM's CPU NIXL worker pins its model thread to the machine's last core; under the launcher a process (and
    the processes it spawns) stays on the cores the container started with."""
    from kvbridge_operator.children.engines.vllm_cpu import CPU_BIND_LAUNCHER

    cores = sorted(os.sched_getaffinity(0))
    mine, other = cores[0], cores[-1]
    show = "print(sorted(os.sched_getaffinity(0)))"
    spawned = f"import os; os.sched_setaffinity(0, {{{other}}}); {show}"
    child = (
        f"import os, subprocess, sys; os.sched_setaffinity(0, {{{other}}}); {show}; "
        f"os.sched_setaffinity(0, {{{mine}, {other}}}); {show}; "
        f"subprocess.run([sys.executable, '-c', {spawned!r}], check=True)"
    )
    result = _launch(
        CPU_BIND_LAUNCHER, 1, sys.executable, "-c", child, preexec_fn=lambda: os.sched_setaffinity(0, {mine})
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [f"[{mine}]"] * 3


#: prints whether Linux granted this process the AMX tile state (arch_prctl(ARCH_GET_XCOMP_PERM): bit 18, XTILEDATA)
_SHOW_TILE_PERMISSION = (
    "import ctypes; mask = ctypes.c_uint64(0); "
    "assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0; print(bool(mask.value >> 18 & 1), "
    "flush=True)"
)


def _kernel_grants_amx_tiles() -> bool:
    """Linux on x86 with AMX tiles it can grant (arch_prctl(ARCH_GET_XCOMP_SUPP) lists XTILEDATA, bit 18)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return False
    import ctypes

    supported = ctypes.c_uint64(0)
    return bool(ctypes.CDLL(None).syscall(158, 0x1021, ctypes.byref(supported)) == 0 and supported.value >> 18 & 1)


@pytest.mark.skipif(not _kernel_grants_amx_tiles(), reason="needs Linux on an x86 CPU with AMX tiles")
def test_the_cpu_launcher_gives_vllm_processes_the_amx_tile_state() -> None:
    """vLLM 0.32's CPU attention uses AMX tiles without asking Linux for them (SIGILL at a decode engine's first
    step, exit code -4): under the launcher the process, and a process it spawns, have them before they run."""
    from kvbridge_operator.children.engines.vllm_cpu import CPU_BIND_LAUNCHER

    child = (
        f"import subprocess, sys; {_SHOW_TILE_PERMISSION}; "
        f"subprocess.run([sys.executable, '-c', {_SHOW_TILE_PERMISSION!r}], check=True)"
    )
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    unasked = subprocess.run(
        [sys.executable, "-c", _SHOW_TILE_PERMISSION], capture_output=True, text=True, timeout=30, env=environ
    )
    assert unasked.stdout.strip() == "False", unasked.stderr  # the check can fail: a plain process has not asked
    result = _launch(CPU_BIND_LAUNCHER, 1, sys.executable, "-c", child, without=("PYTHONPATH",))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]  # the launched process, then the one it spawned
    assert "kvbridge:" not in result.stderr


def test_the_cpu_launcher_refuses_fewer_cores_than_ranks() -> None:
    from kvbridge_operator.children.engines.vllm_cpu import CPU_BIND_LAUNCHER

    probe = f"import os; os.sched_getaffinity = lambda pid: {{0}}; exec(compile({CPU_BIND_LAUNCHER!r}, 'l', 'exec'))"
    result = _launch(probe, 2, "true")
    assert result.returncode != 0
    assert "1 CPU(s) available for tensor-parallel size 2" in result.stderr


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"decode": {"blockSize": 16}}, ("VLLM_CPU_BLOCK_SIZE", "spec.decode.blockSize")),
        ({"prefill": {"blockSize": 48}}, ("VLLM_CPU_BLOCK_SIZE", "spec.prefill.blockSize")),
        ({"decode": {"kvLayout": "NHD"}}, ("VLLM_CPU_KV_LAYOUT", "spec.decode.kvLayout")),
        ({"decode": {"blockSize": 64}}, ("VLLM_CPU_BLOCK_SIZE_RATIO", "spec.decode.blockSize")),
        ({"model": {"cacheKind": "CrossLayer"}}, ("VLLM_CPU_CACHE_KIND", "spec.model.cacheKind")),
        ({"model": {"kvCacheDtype": "fp8_e4m3"}}, ("VLLM_CPU_KV_CACHE_DTYPE", "spec.model.kvCacheDtype")),
    ],
)
def test_what_vllm_on_cpu_cannot_run_is_refused_with_the_field(
    change: dict[str, Any], expected: tuple[str, str]
) -> None:
    doc = cpu_document()
    for section, values in change.items():
        doc["spec"][section].update(values)
    assert expected in codes(verdict(doc))
    doc["spec"]["engine"]["device"] = "GPU"  # the same settings on GPUs are not CPU problems
    result = verdict(doc)
    assert not isinstance(result, list) or not any(p.code.startswith("VLLM_CPU_") for p in result)


def test_the_block_size_ratio_refusal_says_what_would_work() -> None:
    doc = cpu_document()
    doc["spec"]["decode"]["blockSize"] = 64
    [problem] = [p for p in verdict(doc) if p.code == "VLLM_CPU_BLOCK_SIZE_RATIO"]
    assert "wrong tokens" in problem.message
    assert problem.message.endswith("set spec.decode.blockSize: 32")


def test_the_lease_reaches_vllm() -> None:
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["transfer"] = {"leaseSeconds": 300}
    for role in (Role.PREFILL, Role.DECODE):
        config = json.loads(flag(engine(doc, role)["args"], "--kv-transfer-config"))
        assert config["kv_connector_extra_config"]["kv_lease_duration"] == 300


def kvbridge_connector(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"]["engine"]["connector"] = "KVBridge"
    return doc


def test_the_kvbridge_connector_is_loaded_from_the_agent_and_gets_the_keys() -> None:
    doc = kvbridge_connector(document("tiny-cpu"))
    assert not isinstance(verdict(doc), list)
    for role, kv_role in ((Role.PREFILL, "kv_producer"), (Role.DECODE, "kv_consumer")):
        pod = template(doc, role)
        container = engine(doc, role)
        config = json.loads(flag(container["command"] + container.get("args", []), "--kv-transfer-config"))
        assert config == {
            "kv_connector": "KVBridgeConnector",
            "kv_role": kv_role,
            "kv_buffer_device": "cpu",
            "kv_connector_module_path": "kvbridge_agent.vllm_connector",
        }
        variables = env(container)
        assert variables["KVBRIDGE_KEYS_DIR"] == OperatorConfig().keys_mount_path
        assert {"name": "side-channel-keys", "mountPath": OperatorConfig().keys_mount_path, "readOnly": True} in (
            container["volumeMounts"]
        )
        [keys] = [v for v in pod["spec"]["volumes"] if v["name"] == "side-channel-keys"]
        assert keys["secret"]["secretName"] == "tiny-cpu-side-channel"
    for obj in desired_children(parse_deployment(doc), UID, verdict(doc), OperatorConfig()):
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_nixl_pods_get_no_keys() -> None:
    container = engine(document("tiny-cpu"), Role.PREFILL)
    assert env(container)["KVBRIDGE_KEYS_DIR"] == ""
    assert all(m["name"] != "side-channel-keys" for m in container.get("volumeMounts", []))


def transfer_config(doc: dict[str, Any], role: Role) -> dict[str, Any]:
    container = engine(doc, role)
    config: dict[str, Any] = json.loads(flag(container["command"] + container.get("args", []), "--kv-transfer-config"))
    return config


def test_the_kvbridge_connector_renders_on_gpus_with_the_buffer_device_asked() -> None:
    """engine.device GPU with connector KVBridge renders (it was refused, VLLM_KVBRIDGE_GPU_*): kvbridge's connector
    on vLLM's GPU engine, its GPUs, the side-channel keys, and vLLM's kv_buffer_device from
    spec.transfer.network.kvBufferDevice (cuda unless asked: GPUDirect RDMA; cpu: the host buffer, for nodes
    without it, which both connectors have)."""
    doc = kvbridge_connector(document("llama3-8b-hetero-tp"))  # prefill TP 2, decode TP 1: a TP mapping
    assert not isinstance(verdict(doc), list)
    for role, kv_role, gpus in ((Role.PREFILL, "kv_producer", "2"), (Role.DECODE, "kv_consumer", "1")):
        assert transfer_config(doc, role) == {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge_agent.vllm_connector",
            "kv_role": kv_role,
            "kv_buffer_device": "cuda",
        }
        container = engine(doc, role)
        assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}
        assert flag(container["args"], "--attention-backend") == "FLASH_ATTN"
        assert env(container)["KVBRIDGE_KEYS_DIR"] == OperatorConfig().keys_mount_path
    for obj in desired_children(parse_deployment(doc), UID, verdict(doc), OperatorConfig()):
        kubernetes_validate.validate(obj, "1.30", strict=True)
    for connector in (doc, document("llama3-8b-hetero-tp")):  # kvbridge's, and vLLM's NixlConnector
        connector["spec"]["transfer"] = {"network": {"kvBufferDevice": "cpu"}}  # a node without GPUDirect RDMA
        assert not isinstance(verdict(connector), list)
        assert {transfer_config(connector, role)["kv_buffer_device"] for role in Role} == {"cpu"}


def test_a_gpu_buffer_on_vllms_cpu_build_is_refused_with_the_fix() -> None:
    for connector in ("Nixl", "KVBridge"):
        doc = document("tiny-cpu")
        doc["spec"]["engine"]["connector"] = connector
        doc["spec"]["transfer"] = {"network": {"kvBufferDevice": "cuda"}}
        problems = verdict(doc)
        assert [(p.code, p.field) for p in problems] == [
            ("VLLM_KV_BUFFER_DEVICE", "spec.transfer.network.kvBufferDevice")
        ]
        assert problems[0].message.endswith("set spec.transfer.network.kvBufferDevice: cpu")
        doc["spec"]["transfer"] = {"network": {"kvBufferDevice": "cpu"}}
        assert not isinstance(verdict(doc), list)
        assert {transfer_config(doc, role)["kv_buffer_device"] for role in Role} == {"cpu"}


def plan_cli(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(path), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_plan_says_what_runs_the_engines_in_the_json(tmp_path: Path) -> None:
    """The engine object: kind, device, connector, kvBufferDevice, and what has been run for real of the
    configuration (tests/operator/test_plan_provenance.py checks the table)."""
    path = tmp_path / "gpu-kvbridge.yaml"
    doc = kvbridge_connector(document("llama3-8b-hetero-tp"))
    path.write_text(yaml.safe_dump(doc))
    done = plan_cli(path, "--json")
    assert done.returncode == 0, done.stderr
    [entry] = json.loads(done.stdout)
    engine_json = {"kind": "VLLM", "device": "GPU", "connector": "KVBridge", "kvBufferDevice": "cuda"}
    assert {k: v for k, v in entry["engine"].items() if k != "provenance"} == engine_json
    assert entry["engine"]["provenance"]["notRunYet"] == [
        "real vLLM on GPUs (tests/gpu/test_vllm_gpu.py: skipped without a GPU and vLLM's GPU build)"
    ]
    assert entry["vllm"]["prefill"]["kvTransferConfig"]["kv_buffer_device"] == "cuda"
    [nixl] = json.loads(plan_cli(ROOT / "examples" / "vllm" / "tiny-cpu.yaml", "--json").stdout)
    assert {k: v for k, v in nixl["engine"].items() if k != "provenance"} == {
        "kind": "VLLM",
        "device": "CPU",
        "connector": "Nixl",
        "kvBufferDevice": "cpu",
    }


@pytest.mark.parametrize("blocks", [(32, 64), (64, 32), (32, 128)])
def test_kvbridge_converts_block_sizes_on_cpu_where_nixl_is_refused(blocks: tuple[int, int]) -> None:
    doc = document("tiny-cpu")
    doc["spec"]["prefill"]["blockSize"], doc["spec"]["decode"]["blockSize"] = blocks
    assert {p.code for p in verdict(doc)} >= {"VLLM_CPU_BLOCK_SIZE_RATIO"}  # NixlConnector: wrong tokens
    plan = verdict(kvbridge_connector(doc))
    assert not isinstance(plan, list)
    container = engine(doc, Role.PREFILL)
    command = container["command"] + container.get("args", [])
    # prefill re-lays its blocks for the wire when they are larger: its prefix cache must not keep them
    assert ("--no-enable-prefix-caching" in command) == (blocks[0] > blocks[1])


def test_kvbridge_on_cpu_refuses_replicated_heads() -> None:
    doc = kvbridge_connector(document("tiny-cpu"))
    doc["spec"]["prefill"]["tensorParallelSize"] = 4  # the tiny model has 2 KV heads
    problems = verdict(doc)
    assert isinstance(problems, list)
    assert ("VLLM_KVBRIDGE_REPLICATED_HEADS", "spec.prefill.tensorParallelSize") in {
        (p.code, p.field) for p in problems
    }


def test_the_advice_for_a_prefill_conversion_does_not_loop() -> None:
    """The prefill-side conversion's advice offers a block size NixlConnector can run, or kvbridge's connector where
    it converts (on CPUs, and on GPU layouts by descriptors): every suggestion must lead somewhere that passes."""
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["prefill"]["blockSize"] = 32
    [problem] = [p for p in verdict(doc) if p.code == "VLLM_PREFILL_CONVERSION"]
    assert problem.message.endswith("set spec.prefill.blockSize: 16, or spec.engine.connector: KVBridge")
    assert not isinstance(verdict(kvbridge_connector(json.loads(json.dumps(doc)))), list)  # it splits by descriptors
    doc["spec"]["prefill"]["blockSize"] = 16
    assert not isinstance(verdict(doc), list)  # the advice, applied, passes
    on_cpu = document("tiny-cpu")
    on_cpu["spec"]["prefill"]["blockSize"], on_cpu["spec"]["decode"]["blockSize"] = 64, 32
    [cpu_problem] = [p for p in verdict(on_cpu) if p.code == "VLLM_PREFILL_CONVERSION"]
    assert "spec.engine.connector: KVBridge" in cpu_problem.message  # where kvbridge's connector runs, it converts
    on_cpu["spec"]["engine"]["connector"] = "KVBridge"
    assert not isinstance(verdict(on_cpu), list)


def test_messages_speak_of_the_product_not_of_where_it_was_built() -> None:
    doc = document("llama3-8b-hetero-tp")
    doc["spec"]["transfer"] = {"verification": "All"}
    doc["spec"]["router"] = {"enabled": True, "signTransfers": True}
    for problem in [*verdict(doc), *advisories_for(parse_deployment(document("llama3-8b-hetero-tp")).spec)]:
        assert "here" not in problem.message
        assert "so far" not in problem.message


def test_verification_all_is_refused_where_the_connector_cannot_verify() -> None:
    """spec.transfer.verification: All is a promise NixlConnector cannot keep (it has no transfer digest): refused
    with the way out, on GPUs as on CPUs; kvbridge's connector takes it, and renders it for both roles."""
    for name in ("tiny-cpu", "llama3-8b-hetero-tp"):
        doc = document(name)
        doc["spec"]["decode"]["tensorParallelSize"] = doc["spec"]["prefill"]["tensorParallelSize"]
        doc["spec"]["transfer"] = {**doc["spec"].get("transfer", {}), "verification": "All"}
        [problem] = [p for p in verdict(doc) if p.code == "VLLM_NIXL_UNVERIFIED"]
        assert problem.field == "spec.transfer.verification"
        assert problem.message.endswith(
            "set spec.engine.connector: KVBridge, or spec.transfer.verification: Off to run unverified"
        )
        fixed = kvbridge_connector(json.loads(json.dumps(doc)))  # either way out, applied, passes
        assert not isinstance(verdict(fixed), list)
        for role in Role:
            assert env(engine(fixed, role))["KVBRIDGE_VERIFICATION"] == "All"
        doc["spec"]["transfer"]["verification"] = "Off"
        assert not isinstance(verdict(doc), list)


@pytest.mark.parametrize("name", ["tiny-cpu", "llama3-8b-hetero-tp"])
def test_sampled_verification_with_nixl_runs_but_is_never_dropped_silently(name: str) -> None:
    """verification: Sampled is the default, so refusing it with NixlConnector (no transfer digest) would refuse
    every default spec: it runs, with an advisory naming the code, the field and the fix (plan and status use
    it); kvbridge's connector verifies, and Off says what runs: neither has one."""
    doc = document(name)
    assert not isinstance(verdict(doc), list)
    [advisory] = advisories_for(parse_deployment(doc).spec)
    assert (advisory.code, advisory.field) == ("VLLM_NIXL_UNVERIFIED_SAMPLED", "spec.transfer.verification")
    assert "run unverified" in advisory.message
    assert advisory.message.endswith(
        "set spec.engine.connector: KVBridge to verify, or spec.transfer.verification: Off to say so"
    )
    assert advisories_for(parse_deployment(kvbridge_connector(json.loads(json.dumps(doc)))).spec) == []
    doc["spec"]["transfer"] = {**doc["spec"].get("transfer", {}), "verification": "Off"}
    assert advisories_for(parse_deployment(doc).spec) == []
    agent = document(name)
    agent["spec"]["engine"] = {"kind": "Synthetic"}
    assert advisories_for(parse_deployment(agent).spec) == []


def test_plan_lists_the_unverified_default_with_its_code_field_and_fix(tmp_path: Path) -> None:
    """kvbridge plan with NixlConnector and the default verification (Sampled): compatible (exit 0), the JSON's
    advisories name the code, the field and the fix (also on stderr, beside the JSON), the text prints them; with
    kvbridge's connector there is none."""
    path = ROOT / "examples" / "vllm" / "tiny-cpu.yaml"
    done = plan_cli(path, "--json")
    assert done.returncode == 0, done.stderr
    [entry] = json.loads(done.stdout)
    [advisory] = entry["advisories"]
    assert (advisory["code"], advisory["field"]) == ("VLLM_NIXL_UNVERIFIED_SAMPLED", "spec.transfer.verification")
    assert "spec.engine.connector: KVBridge" in advisory["message"]
    assert entry["verification"] == {"policy": "Off", "firstSeconds": 300, "fraction": 0.05, "supported": False}
    assert "kvbridge plan: warning: " in done.stderr
    assert "VLLM_NIXL_UNVERIFIED_SAMPLED at spec.transfer.verification" in done.stderr
    text = plan_cli(path)
    assert text.returncode == 0
    assert "  warning: VLLM_NIXL_UNVERIFIED_SAMPLED at spec.transfer.verification" in text.stdout.splitlines()
    verified = tmp_path / "kvbridge.yaml"
    verified.write_text(yaml.safe_dump(kvbridge_connector(document("tiny-cpu"))))
    [entry] = json.loads(plan_cli(verified, "--json").stdout)
    assert entry["advisories"] == []
    assert "warning" not in plan_cli(verified).stdout


def test_the_gpu_suites_deployments_render_on_this_machine() -> None:
    """tests/gpu runs only on a GPU machine; what it starts is checked here: every case is compatible and renders
    its connector, kv_buffer_device and verification for both roles."""
    from tests.gpu.test_vllm_gpu import CASES, gpu_deployment

    for case in CASES:
        doc = gpu_deployment(case)
        assert not isinstance(verdict(doc), list), case
        for role in Role:
            config = transfer_config(doc, role)
            assert config["kv_connector"] == f"{case.connector}Connector"
            assert config["kv_buffer_device"] == case.buffer
            assert env(engine(doc, role))["KVBRIDGE_VERIFICATION"] == case.verification


def test_the_hybrid_allocator_stays_on_for_kvbridges_connector_where_it_moves_the_groups() -> None:
    """kvbridge's connector declares SupportsHMA, so vLLM keeps its hybrid allocator on; on the CPU build the
    connector moves each group's blocks in the layer slots the groups share (cache_geometry.group_slots), so nothing
    is rendered — but where it could not move the groups vLLM would make: chunked local attention layers (groups of
    their own) or block sizes that differ between the roles (groups move between equal ones), kvbridge renders
    --disable-hybrid-kv-cache-manager (one group). On GPUs too where the block sizes differ in a model of several
    layer kinds (else plan would pass what every read refuses with CACHE_GROUPS_MISMATCH). NixlConnector's engines
    never get it."""
    flag = "--disable-hybrid-kv-cache-manager"
    sliding = {"layerTypes": ["Sliding", "Full"], "slidingWindow": 32}
    chunked = {"layerTypes": ["ChunkedLocal", "Full"], "attentionChunkSize": 64}
    cases: list[tuple[str, dict[str, Any], tuple[int, int], bool]] = [
        ("KVBridge", {}, (32, 32), False),
        ("KVBridge", sliding, (32, 32), False),
        ("KVBridge", sliding, (32, 64), True),
        ("KVBridge", chunked, (32, 32), True),
        ("Nixl", sliding, (32, 32), False),
    ]
    for connector, model, blocks, wanted in cases:
        doc = document("tiny-cpu")
        doc["spec"]["engine"]["connector"] = connector
        doc["spec"]["model"].update(model)
        doc["spec"]["prefill"]["blockSize"], doc["spec"]["decode"]["blockSize"] = blocks
        assert not isinstance(verdict(doc), list), (connector, model, blocks)
        for role in Role:
            assert (flag in engine(doc, role)["args"]) is wanted, (connector, model, blocks, role)
    on_gpu = kvbridge_connector(document("llama3-8b-hetero-tp"))
    assert all(flag not in engine(on_gpu, role)["args"] for role in Role)
    for blocks, wanted in (((16, 16), False), ((32, 16), True)):
        hybrid_gpu = kvbridge_connector(document("llama3-8b-hetero-tp"))
        hybrid_gpu["spec"]["model"].update({"layerTypes": ["Sliding", "Full"] * 16, "slidingWindow": 4096})
        hybrid_gpu["spec"]["prefill"]["blockSize"], hybrid_gpu["spec"]["decode"]["blockSize"] = blocks
        assert not isinstance(verdict(hybrid_gpu), list), verdict(hybrid_gpu)
        assert all((flag in engine(hybrid_gpu, role)["args"]) is wanted for role in Role), blocks
