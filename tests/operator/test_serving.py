"""spec.router, spec.inferencePool and spec.model.source as rendered: valid objects, least privilege, what vLLM
loads, and the revision in the pairing key."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.names import LABEL_LLM_D_ROLE
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.engines.vllm_problems import problems
from kvbridge_operator.children.objects.desired import desired_children, optional_children
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.rollout import Strategy
from kvbridge_router import cli as router_cli

from .test_rollout import strategy_for

ROOT = Path(__file__).resolve().parents[2]
UID = "00000000-0000-0000-0000-0000000000aa"


def document(name: str = "vllm/llama3-8b-hetero-tp", **spec: Any) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    found["metadata"]["namespace"] = "team-a"
    for key, value in spec.items():
        found["spec"][key] = {**found["spec"].get(key, {}), **value}
    return found


def engine_container(doc: dict[str, Any], role: Role = Role.DECODE) -> dict[str, Any]:
    dd = parse_deployment(doc)
    sts = stateful_set(dd, UID, role, verdict_for(dd), OperatorConfig())  # type: ignore[arg-type]
    kubernetes_validate.validate(sts, "1.30", strict=True)
    return next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


def test_the_router_objects_are_valid_and_the_role_reads_only_this_deployment() -> None:
    dd = parse_deployment(document(router={"enabled": True, "decodeTimeoutSeconds": 90}))
    objects = optional_children(dd, UID, OperatorConfig())
    kinds = ["ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget", "Service"]
    assert [o["kind"] for o in objects] == kinds
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30", strict=True)
        assert obj["metadata"]["name"] == "llama3-8b-vllm-router"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == UID
    role = objects[1]
    assert role["rules"] == [
        {
            "apiGroups": ["kvbridge.io"],
            "resources": ["disaggregateddeployments"],
            "resourceNames": ["llama3-8b-vllm"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    pod = objects[3]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama3-8b-vllm-router"
    assert pod["containers"][0]["image"] == OperatorConfig().router_image
    assert "--decode-timeout=90" in pod["containers"][0]["args"]
    # the router's own program, with flags it parses back to the spec's settings
    assert pod["containers"][0]["command"] == ["kvbridge-router"]
    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert "kvbridge-router" in scripts
    settings = router_cli.chosen(router_cli.build_parser().parse_args(pod["containers"][0]["args"]))
    assert (settings.deployment, settings.namespace) == (dd.metadata.name, dd.metadata.namespace or "default")
    assert (settings.decode_timeout, settings.block_size) == (90, dd.spec.prefill.block_size)
    # kv-aware by default, scoring prompts in the prefill pods' blocks (vLLM hits whole blocks only)
    assert {"--policy=kv-aware", f"--block-size={dd.spec.prefill.block_size}"} <= set(pod["containers"][0]["args"])
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"
    assert optional_children(parse_deployment(document()), UID, OperatorConfig()) == []


def test_the_inference_pool_selects_both_roles_labelled_for_llm_d() -> None:
    doc = document(inferencePool={"enabled": True, "endpointPicker": "llm-d-epp", "gateway": "inference-gw"})
    dd = parse_deployment(doc)
    pool, route = optional_children(dd, UID, OperatorConfig())
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"] == {"matchLabels": {"kvbridge.io/inference-pool": "llama3-8b-vllm"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "llm-d-epp"
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gw"
    backend = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama3-8b-vllm"}
    assert route["spec"]["rules"][0]["backendRefs"] == [backend]
    for role in Role:
        sts = stateful_set(dd, UID, role, verdict_for(dd), OperatorConfig())  # type: ignore[arg-type]
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert labels[LABEL_LLM_D_ROLE] == role.value
        assert labels.items() >= pool["spec"]["selector"]["matchLabels"].items()
    no_gateway = parse_deployment(document(inferencePool={"enabled": True, "endpointPicker": "llm-d-epp"}))
    assert [o["kind"] for o in optional_children(no_gateway, UID, OperatorConfig())] == ["InferencePool"]
    with pytest.raises(SpecError, match="endpointPicker"):
        parse_deployment(document(inferencePool={"enabled": True}))


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels; matchExpressions Exists, DoesNotExist, In) applied to labels."""
    if not labels.items() >= selector.get("matchLabels", {}).items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        if (operator == "Exists" and key not in labels) or (operator == "DoesNotExist" and key in labels):
            return False
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
    return True


def _pod_labels(dd: Any, role: Role) -> dict[str, str]:
    labels: dict[str, str] = stateful_set(dd, UID, role, verdict_for(dd), OperatorConfig())[  # type: ignore[arg-type]
        "spec"
    ]["template"]["metadata"]["labels"]
    return labels


def test_router_pods_are_not_engine_pods() -> None:
    """The engines' NetworkPolicy does not fence the router, and the InferencePool does not count router pods (nor
    the headless workers of multi-node engines) as model servers."""
    config = OperatorConfig()
    dd = parse_deployment(
        document(router={"enabled": True}, inferencePool={"enabled": True, "endpointPicker": "llm-d-epp"})
    )
    extra = optional_children(dd, UID, config)
    router_pod = next(o for o in extra if o["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    pool = next(o for o in extra if o["kind"] == "InferencePool")["spec"]["selector"]
    policy = next(
        c
        for c in desired_children(dd, UID, verdict_for(dd), config)  # type: ignore[arg-type]
        if c["kind"] == "NetworkPolicy"
    )["spec"]
    kubernetes_validate.validate(
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "p"}, "spec": policy},
        "1.30",
        strict=True,
    )
    for role in Role:
        engine = _pod_labels(dd, role)
        assert _selects(policy["podSelector"], engine), role
        assert _selects(pool, engine), role
        assert _selects(policy["ingress"][0]["from"][0]["podSelector"], router_pod)  # the router reaches the engines
    assert not _selects(policy["podSelector"], router_pod)
    assert not _selects(pool, router_pod)
    # an engine spanning nodes: its leader serves the API and is in the pool; its workers serve none
    big = document("vllm/deepseek-v3-h200-two-node-prefill", inferencePool={"enabled": True, "endpointPicker": "epp"})
    big_dd = parse_deployment(big)
    [group] = [
        c
        for c in desired_children(big_dd, UID, verdict_for(big_dd), config)  # type: ignore[arg-type]
        if c["kind"] == "LeaderWorkerSet"
    ]
    templates = group["spec"]["leaderWorkerTemplate"]
    big_pool = next(o for o in optional_children(big_dd, UID, config) if o["kind"] == "InferencePool")["spec"]
    assert _selects(big_pool["selector"], templates["leaderTemplate"]["metadata"]["labels"])
    assert not _selects(big_pool["selector"], templates["workerTemplate"]["metadata"]["labels"])
    # without spec.inferencePool the engines' pods are as before (no label: no rollout of existing deployments)
    plain = parse_deployment(document())
    assert "kvbridge.io/inference-pool" not in _pod_labels(plain, Role.PREFILL)


def test_a_hugging_face_source_pins_the_revision_and_serves_under_the_models_name() -> None:
    doc = document(
        model={
            "source": "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f",
            "tokenSecret": {"name": "hf-token"},
            "cache": {"claimName": "model-cache"},
        }
    )
    engine = engine_container(doc)
    args = engine["args"]
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert args[args.index("--revision") + 1] == "0e9e39f"
    assert args[args.index("--tokenizer-revision") + 1] == "0e9e39f"
    assert args[args.index("--served-model-name") + 1] == doc["spec"]["model"]["name"]
    env = {e["name"]: e for e in engine["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert env["HF_HOME"]["value"] == "/model-cache"
    assert {"name": "model-cache", "mountPath": "/model-cache"} in engine["volumeMounts"]


def test_a_pvc_source_is_mounted_read_only() -> None:
    doc = document(model={"source": "pvc://weights/llama/8b"})
    dd = parse_deployment(doc)
    sts = stateful_set(dd, UID, Role.PREFILL, verdict_for(dd), OperatorConfig())  # type: ignore[arg-type]
    engine = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    assert engine["args"][0] == "/models/weights/llama/8b"
    assert {"name": "model-weights", "mountPath": "/models/weights", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "model-weights", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in sts[
        "spec"
    ]["template"]["spec"]["volumes"]


@pytest.mark.parametrize(
    "source", ["s3://bucket/x", "hf://no-name", "hf://a/b@", "pvc://Upper/x", "hf://a/b@x y", "pvc://claim/../etc"]
)
def test_bad_sources_are_refused(source: str) -> None:
    with pytest.raises(SpecError, match="source"):
        parse_deployment(document(model={"source": source}))


def test_a_token_without_a_download_is_refused() -> None:
    with pytest.raises(SpecError, match="tokenSecret and cache are for downloads"):
        parse_deployment(document(model={"tokenSecret": {"name": "hf-token"}}))


def test_the_source_decides_revision_arguments() -> None:
    dd = parse_deployment(document(model={"source": "hf://org/m@v2"}, engine={"extraArgs": ["--revision=v3"]}))
    assert [p.code for p in problems(dd.spec)] == ["VLLM_MANAGED_ARGUMENT"]
    assert problems(parse_deployment(document(engine={"extraArgs": ["--revision=v3"]})).spec) == []


def test_the_revision_is_in_the_pairing_key_and_a_new_one_rolls_blue_green() -> None:
    base = parse_deployment(document())
    v1 = document(model={"source": "hf://org/m@v1"})
    v2 = document(model={"source": "hf://org/m@v2"})
    keys = {pairing(base.spec), pairing(parse_deployment(v1).spec), pairing(parse_deployment(v2).spec)}
    assert len(keys) == 3
    # the router, the InferencePool and the token do not change what pairs
    same = document(model={"source": "hf://org/m@v1", "tokenSecret": {"name": "t"}}, router={"enabled": True})
    assert pairing(parse_deployment(same).spec) == pairing(parse_deployment(v1).spec)
    strategy, why = strategy_for(_agent(v1), _agent(v2))
    assert strategy is Strategy.BLUE_GREEN
    assert "spec.model differs" in why


def _agent(doc: dict[str, Any]) -> dict[str, Any]:
    """The rollout tests' example with this document's model source."""
    from .test_rollout import changed

    return changed(model={"source": doc["spec"]["model"]["source"]})
