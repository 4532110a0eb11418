"""A role's template overlay cannot change what was checked: refused with its field path and a fix, before
scheduling; what it may change reaches the pod, and ``kvbridge plan`` prints the command the pod runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Role
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.cli.plan_report import engine_commands, plan_document
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
UID = "00000000-0000-0000-0000-0000000000bb"


def document(path: str = "vllm/llama3-8b-hetero-tp") -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{path}.yaml").read_text())
    return found


def with_template(template: dict[str, Any], role: str = "decode", path: str = "vllm/llama3-8b-hetero-tp") -> Any:
    doc = document(path)
    doc["spec"][role]["template"] = template
    return parse_deployment(doc)


def engine(containers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"spec": {"containers": containers}}


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "args replaced (the issue's example)",
        engine([{"name": "engine", "args": ["Qwen/Qwen2.5-7B-Instruct", "--max-num-batched-tokens=8192"]}]),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].args",
    ),
    (
        "command replaced",
        engine([{"name": "engine", "command": ["python", "-m", "vllm.entrypoints.openai"]}]),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].command",
    ),
    (
        "the side-channel port",
        engine([{"name": "engine", "env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "7000"}]}]),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].env[0]",
    ),
    (
        "the cache layout",
        engine(
            [
                {
                    "name": "engine",
                    "env": [{"name": "FOO", "value": "1"}, {"name": "VLLM_KV_CACHE_LAYOUT", "value": "LBNHC"}],
                }
            ]
        ),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].env[1]",
    ),
    (
        "the agent's contract",
        engine([{"name": "engine", "env": [{"name": "KVBRIDGE_ROLE", "value": "Prefill"}]}]),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].env[0]",
    ),
    (
        "the side channel's host from elsewhere",
        engine(
            [
                {
                    "name": "engine",
                    "env": [
                        {
                            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}},
                        }
                    ],
                }
            ]
        ),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].env[0]",
    ),
    (
        "the HTTP port",
        engine([{"name": "engine", "ports": [{"name": "http", "containerPort": 9000}]}]),
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.containers[0].ports[0]",
    ),
    (
        "GPUs other than the ranks",
        engine([{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 4}}}]),
        "TEMPLATE_GPUS",
        "spec.decode.template.spec.containers[0].resources.limits.nvidia.com/gpu",
    ),
    (
        "the pairing label",
        {"metadata": {"labels": {"kvbridge.io/pairing": "mine"}}},
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.metadata.labels.kvbridge.io/pairing",
    ),
    (
        "llm-d's role label",
        {"metadata": {"labels": {"llm-d.ai/role": "prefill"}}},
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.metadata.labels.llm-d.ai/role",
    ),
    (
        "containers not a list",
        {"spec": {"containers": {"engine": {"image": "x"}}}},
        "TEMPLATE_INVALID",
        "spec.decode.template.spec.containers",
    ),
    (
        "a container without a name",
        engine([{"image": "x"}]),
        "TEMPLATE_INVALID",
        "spec.decode.template.spec.containers",
    ),
]


@pytest.mark.parametrize(("what", "template", "code", "field"), REFUSED, ids=[r[0] for r in REFUSED])
def test_an_overlay_that_changes_what_was_checked_is_refused(
    what: str, template: dict[str, Any], code: str, field: str
) -> None:
    verdict = verdict_for(with_template(template))
    assert isinstance(verdict, list), what
    found = [(p.code, p.field) for p in verdict]
    assert (code, field) in found, found
    problem = next(p for p in verdict if p.field == field)
    assert "remove" in problem.message or "write" in problem.message  # says what to do instead


def test_the_same_overlay_on_prefill_names_prefill() -> None:
    verdict = verdict_for(with_template(engine([{"name": "engine", "args": ["x"]}]), role="prefill"))
    assert isinstance(verdict, list)
    assert verdict[0].field == "spec.prefill.template.spec.containers[0].args"


ALLOWED = {
    "image": engine([{"name": "engine", "image": "registry.example/vllm:0.32.0-patched"}]),
    "cpu and memory": engine([{"name": "engine", "resources": {"requests": {"cpu": "16", "memory": "200Gi"}}}]),
    "the right GPUs": engine([{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 1}}}]),
    "an env of one's own": engine(
        [{"name": "engine", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "HF_HUB_OFFLINE", "value": "1"}]}]
    ),
    "a sidecar": engine([{"name": "log-shipper", "image": "fluent-bit:3", "args": ["-c", "/etc/fb.conf"]}]),
    "scheduling": {
        "spec": {
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "priorityClassName": "inference",
        }
    },
    "labels and annotations of one's own": {"metadata": {"labels": {"team": "a"}, "annotations": {"x": "y"}}},
}


@pytest.mark.parametrize("what", sorted(ALLOWED))
def test_an_allowed_overlay_reaches_the_pod_and_keeps_what_was_checked(what: str) -> None:
    plain = parse_deployment(document())
    dd = with_template(copy.deepcopy(ALLOWED[what]))
    plan = verdict_for(dd)
    assert not isinstance(plan, list), plan
    rendered = stateful_set(dd, UID, Role.DECODE, plan, OperatorConfig())["spec"]["template"]
    before = stateful_set(plain, UID, Role.DECODE, plan, OperatorConfig())["spec"]["template"]
    new, old = (next(c for c in t["spec"]["containers"] if c["name"] == "engine") for t in (rendered, before))
    assert new["command"] == old["command"]
    assert new["args"] == old["args"]  # the checked command line, untouched
    assert {e["name"] for e in old["env"]} <= {e["name"] for e in new["env"]}
    for key in ("kvbridge.io/pairing", "kvbridge.io/fingerprint", "kvbridge.io/role"):
        assert rendered["metadata"]["labels"][key] == before["metadata"]["labels"][key]
    if what == "image":
        assert new["image"] == "registry.example/vllm:0.32.0-patched"
    if what == "a sidecar":
        assert [c["name"] for c in rendered["spec"]["containers"]] == ["engine", "log-shipper"]
    if what == "scheduling":
        assert rendered["spec"]["nodeSelector"] == {"gpu": "h100"}


def test_role_extra_args_reach_that_roles_pods_and_are_checked() -> None:
    doc = document()
    doc["spec"]["decode"]["extraArgs"] = ["--max-num-batched-tokens=8192"]
    dd = parse_deployment(doc)
    plan = verdict_for(dd)
    assert not isinstance(plan, list), plan
    for role, expected in ((Role.DECODE, True), (Role.PREFILL, False)):
        container = stateful_set(dd, UID, role, plan, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]
        assert ("--max-num-batched-tokens=8192" in container["args"]) is expected
        assert "--kv-transfer-config" in container["args"]
    doc["spec"]["decode"]["extraArgs"] = ["--block-size=32"]
    refused = verdict_for(parse_deployment(doc))
    assert isinstance(refused, list)
    assert [(p.code, p.field) for p in refused] == [("VLLM_MANAGED_ARGUMENT", "spec.decode.extraArgs")]
    agent = document("synthetic/llama3-8b-hetero-tp")
    agent["spec"]["prefill"]["extraArgs"] = ["--x"]
    refused = verdict_for(parse_deployment(agent))
    assert isinstance(refused, list)
    assert [(p.code, p.field) for p in refused] == [("EXTRA_ARGS_NEED_VLLM", "spec.prefill.extraArgs")]


def test_kvbridge_plan_prints_the_command_and_environment_the_pod_runs() -> None:
    doc = document()
    doc["spec"]["decode"]["extraArgs"] = ["--max-num-batched-tokens=8192"]
    doc["spec"]["decode"]["template"] = engine(
        [
            {
                "name": "engine",
                "env": [
                    {"name": "NCCL_DEBUG", "value": "INFO"},
                    {"name": "HF_HUB_TOKEN_FILE", "valueFrom": {"secretKeyRef": {"name": "t", "key": "k"}}},
                ],
            }
        ]
    )
    dd = parse_deployment(doc)
    printed = engine_commands(plan_document(dd))
    plan = verdict_for(dd)
    assert not isinstance(plan, list)
    for role in Role:
        container = stateful_set(dd, UID, role, plan, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]
        shown = printed[role.value.lower()]
        assert [*shown["launcher"], *shown["command"]] == [*container["command"], *container["args"]]
        env = {e["name"]: e.get("value", f"<{next(iter(e.get('valueFrom', {})), '')}>") for e in container["env"]}
        for name, value in shown["env"].items():
            assert name in env, name
            if not value.startswith("<"):
                assert env[name] == value, name
    assert printed["decode"]["env"]["NCCL_DEBUG"] == "INFO"
    assert printed["decode"]["env"]["HF_HUB_TOKEN_FILE"] == "<secretKeyRef>"
    assert "NCCL_DEBUG" not in printed["prefill"]["env"]


@pytest.mark.parametrize("connector", ["Nixl", "KVBridge"])
def test_plan_json_gives_the_whole_environment_each_role_runs_with(connector: str) -> None:
    """`kvbridge plan --json` has, per role, the command and the engine container's whole environment (kvbridge's
    contract included; downward-API values named): enough to start the role outside Kubernetes."""
    doc = document("vllm/tiny-cpu")
    doc["spec"]["engine"]["connector"] = connector
    dd = parse_deployment(doc)
    plan = verdict_for(dd)
    assert not isinstance(plan, list), plan
    printed = engine_commands(plan_document(dd))
    for role in Role:
        container = stateful_set(dd, UID, role, plan, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]
        environment = printed[role.value.lower()]["environment"]
        assert set(environment) == {e["name"] for e in container["env"]}
        assert environment["KVBRIDGE_ENGINE_ID"] == "<metadata.name>"
        assert environment["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "<status.podIP>"
        assert environment["KVBRIDGE_ROLE"] == role.value
        assert environment["KVBRIDGE_MODEL_NAME"] == doc["spec"]["model"]["name"]
        assert (environment["KVBRIDGE_KEYS_DIR"] != "") is (connector == "KVBridge")


RENDERED = [(p.stem, "Nixl") for p in sorted((ROOT / "examples" / "vllm").glob("*.yaml"))] + [("tiny-cpu", "KVBridge")]


@pytest.mark.parametrize(("example", "connector"), RENDERED)
def test_every_variable_kvbridge_renders_is_one_an_overlay_may_not_set(example: str, connector: str) -> None:
    """The overlay rule's list of managed names follows the renderer: nothing kvbridge sets on the engine
    container can be overridden by a template (a new variable in the renderer must join the list)."""
    from kvbridge_operator.children.objects.desired import desired_children
    from kvbridge_operator.children.templates import MANAGED_ENV, MANAGED_ENV_PREFIX

    doc = document(f"vllm/{example}")
    doc["spec"]["engine"]["connector"] = connector
    dd = parse_deployment(doc)
    plan = verdict_for(dd)
    assert not isinstance(plan, list), plan
    names = set()
    for child in desired_children(dd, UID, plan, OperatorConfig()):
        spec = child["spec"]
        group = spec.get("leaderWorkerTemplate")
        for template in [group["leaderTemplate"], group["workerTemplate"]] if group else [spec.get("template")]:
            for container in (template or {}).get("spec", {}).get("containers", []):
                if container["name"] == "engine":
                    names |= {variable["name"] for variable in container["env"]}
    assert names  # the engine's environment was found
    assert {n for n in names if not n.startswith(MANAGED_ENV_PREFIX) and n not in MANAGED_ENV} == set()
