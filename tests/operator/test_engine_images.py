"""Issue 59, item 2: the image a pod runs is part of the check. `kvbridge plan` names each role's image and where it
comes from; with `connector: KVBridge` the operator's default is kvbridge's engine image, and vLLM's own images (which
cannot load kvbridge's connector) are refused by the model (plan and operator), by the CRD's rule at `kubectl apply`,
and as the operator's own setting."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.crd import SPEC_RULES
from kvbridge_operator.api.images import KVBRIDGE_ENGINE_REPOSITORY, lacks_connector
from kvbridge_operator.api.names import ENGINE_CONTAINER
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.pod import pod_template
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.cli.main import main
from kvbridge_operator.cli.plan_report import images_of
from kvbridge_operator.config import OperatorConfig

from .schema_tools import cel_failures

ROOT = Path(__file__).resolve().parents[2]
STOCK = [
    "vllm/vllm-openai:v0.32.0",
    "vllm/vllm-openai",
    "docker.io/vllm/vllm-openai:latest",
    "index.docker.io/vllm/vllm-openai@sha256:" + "0" * 64,
    "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0",
    "public.ecr.aws/q9t5s3a7/vllm-release-repo:abc",
]
OTHERS = [
    "ghcr.io/kvbridge/vllm-engine:0.1.0",
    "registry.example.com/ml/vllm-openai:v0.32.0",  # someone's own build, under the same last name
    "vllm/vllm-openai-with-kvbridge:1",
    "myvllm/vllm-openai:1",
    "",
]


def document(name: str = "vllm/llama3-8b-hetero-tp", **engine: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    doc["spec"].setdefault("engine", {}).update(engine)
    return doc


@pytest.mark.parametrize("image", STOCK + OTHERS)
def test_the_model_and_the_crd_rule_refuse_the_same_images(image: str) -> None:
    doc = document(connector="KVBridge", image=image)
    refused: list[SpecError] = []
    try:
        parse_deployment(doc)
    except SpecError as exc:
        refused.append(exc)
    refused_by_model = bool(refused)
    assert all((e.code, e.field) == ("IMAGE_LACKS_CONNECTOR", "spec.engine.image") for e in refused)
    [rule] = [r for r in SPEC_RULES if r.get("fieldPath") == ".engine.image"]
    refused_by_crd = bool(cel_failures([rule], doc["spec"]))
    assert refused_by_model is refused_by_crd is (image in STOCK) is lacks_connector(image)


@pytest.mark.parametrize("image", STOCK)
def test_vllms_own_images_stay_fine_for_nixl_and_the_synthetic_engine(image: str) -> None:
    parse_deployment(document(image=image))  # NixlConnector: vLLM's own image is the default
    parse_deployment(document("synthetic/llama3-8b-hetero-tp", image=image))


def test_a_role_overlay_naming_vllms_image_is_refused_too() -> None:
    doc = document(connector="KVBridge")
    doc["spec"]["decode"]["template"] = {
        "spec": {"containers": [{"name": ENGINE_CONTAINER, "image": "vllm/vllm-openai:v0.32.0"}]}
    }
    with pytest.raises(SpecError) as caught:
        parse_deployment(doc)
    assert (caught.value.code, caught.value.field) == ("IMAGE_LACKS_CONNECTOR", "spec.decode.template")
    assert "the engine container's image 'vllm/vllm-openai:v0.32.0' is one of vLLM's own" in caught.value.message


def test_the_refusal_says_what_to_use_instead(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "stock.yaml"
    path.write_text(yaml.safe_dump(document(connector="KVBridge", image="vllm/vllm-openai:v0.32.0")))
    assert main(["plan", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.engine.image: 'vllm/vllm-openai:v0.32.0' is one of vLLM's own images" in err
    assert KVBRIDGE_ENGINE_REPOSITORY in err
    assert "spec.engine.connector: Nixl" in err


@pytest.mark.parametrize(
    ("engine", "image", "source"),
    [
        ({}, "vllm/vllm-openai:v0.32.0", "--vllm-image"),
        ({"connector": "KVBridge"}, f"{KVBRIDGE_ENGINE_REPOSITORY}:0.1.0", "--kvbridge-vllm-image"),
        ({"connector": "KVBridge", "image": "r.example/vllm-kv:1"}, "r.example/vllm-kv:1", "spec.engine.image"),
    ],
)
def test_plan_names_each_roles_image_and_where_it_comes_from(
    engine: dict[str, str], image: str, source: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(document(**engine)))
    assert main(["plan", "-f", str(path), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["images"] == {role: {"image": image, "source": source} for role in ("prefill", "decode")}
    assert main(["plan", "-f", str(path)]) == 0
    second = capsys.readouterr().out.splitlines()[1]
    assert second.startswith(f"  image: {image} (")
    assert "for both roles" in second


@pytest.mark.parametrize(
    ("name", "engine", "setting"),
    [
        ("vllm/llama3-8b-hetero-tp", {}, "vllm_image"),
        ("vllm/tiny-cpu", {}, "vllm_cpu_image"),
        ("vllm/llama3-8b-hetero-tp", {"connector": "KVBridge"}, "kvbridge_vllm_image"),
        ("vllm/small-cpu-kv-aware", {}, "kvbridge_vllm_cpu_image"),
        ("synthetic/llama3-8b-hetero-tp", {}, "synthetic_image"),
    ],
)
def test_what_plan_names_is_what_the_pods_run(name: str, engine: dict[str, str], setting: str) -> None:
    """The image plan names per role is the rendered pod's, with an operator default of its own (so a changed
    setting shows), and with a role's overlay winning for that role alone."""
    own: dict[str, Any] = {setting: "example.com/own:7"}
    config = dataclasses.replace(OperatorConfig(), **own)
    doc = document(name, **engine)
    doc["spec"]["prefill"]["template"] = {
        "spec": {"containers": [{"name": ENGINE_CONTAINER, "image": "p.example/x:1"}]}
    }
    dd = parse_deployment(doc)
    plan = verdict_for(dd, config)
    assert not isinstance(plan, list)
    named = images_of(dd, config)
    assert named["prefill"] == {"image": "p.example/x:1", "source": "spec.prefill.template"}
    assert named["decode"]["image"] == "example.com/own:7"
    for role in Role:
        containers = pod_template(dd, role, plan, config)["spec"]["containers"]
        [engine_container] = [c for c in containers if c["name"] == ENGINE_CONTAINER]
        assert engine_container["image"] == named[role.value]["image"]


@pytest.mark.parametrize("setting", ["kvbridge_vllm_image", "kvbridge_vllm_cpu_image"])
def test_the_operator_refuses_vllms_own_image_as_its_kvbridge_default(setting: str) -> None:
    stock: dict[str, Any] = {setting: "vllm/vllm-openai:v0.32.0"}
    with pytest.raises(SpecError) as caught:
        dataclasses.replace(OperatorConfig(), **stock)
    assert caught.value.code == "IMAGE_LACKS_CONNECTOR"
    assert caught.value.field == f"KVBRIDGE_OPERATOR_{setting.upper()}"
