"""spec.tracing: off by default; set, the standard OTEL_* environment on the engine pods and the router and vLLM's
own --otlp-traces-endpoint on vLLM engines; bad values refused by the models, the CRD schema and ``kvbridge plan``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.crd import crd
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.api.tracing import TRACING_ENDPOINT_PATTERN
from kvbridge_operator.children.objects.desired import optional_children
from kvbridge_operator.cli.main import main
from kvbridge_operator.config import OperatorConfig

from .test_serving import UID, document, engine_container

GRPC = {"endpoint": "http://otel-collector.observability:4317", "samplingRatio": 0.25}
HTTP = {"endpoint": "https://tempo.example.com:4318/v1/traces", "protocol": "http/protobuf"}
OTEL = {
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SERVICE_NAME",
}


def environment(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def router_container(doc: dict[str, Any]) -> dict[str, Any]:
    objects = optional_children(parse_deployment(doc), UID, OperatorConfig())
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_tracing_is_off_by_default_no_variable_no_flag() -> None:
    doc = document(router={"enabled": True})
    assert parse_deployment(doc).spec.tracing is None
    for role in Role:
        container = engine_container(doc, role)
        assert not OTEL & environment(container).keys()
        assert "--otlp-traces-endpoint" not in container["args"]
    assert not OTEL & environment(router_container(doc)).keys()


@pytest.mark.parametrize("role", list(Role))
def test_engines_get_the_otel_environment_and_vllms_flag(role: Role) -> None:
    container = engine_container(document(tracing=GRPC), role)
    env = environment(container)
    assert {name: env[name] for name in OTEL} == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": GRPC["endpoint"],
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_SERVICE_NAME": f"llama3-8b-vllm-{role.value}",
    }
    args = container["args"]
    assert args[args.index("--otlp-traces-endpoint") + 1] == GRPC["endpoint"]


def test_the_router_gets_the_otel_environment_of_its_own_service() -> None:
    env = environment(router_container(document(router={"enabled": True}, tracing=HTTP)))
    assert env["OTEL_SERVICE_NAME"] == "llama3-8b-vllm-router"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == HTTP["endpoint"]
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "1"  # the default ratio: every new trace


@pytest.mark.parametrize(
    ("tracing", "code", "field"),
    [
        ({"endpoint": "otel-collector:4317"}, "TRACING_ENDPOINT_INVALID", "spec.tracing.endpoint"),
        ({"endpoint": "http://user:pw@collector:4317"}, "TRACING_ENDPOINT_INVALID", "spec.tracing.endpoint"),
        ({"endpoint": "http://collector:4317/?x=1"}, "TRACING_ENDPOINT_INVALID", "spec.tracing.endpoint"),
        ({"endpoint": "http://collector:4317\n"}, "TRACING_ENDPOINT_INVALID", "spec.tracing.endpoint"),
        ({"endpoint": "http://c:4317/v1/traces"}, "TRACING_ENDPOINT_PATH", "spec.tracing.endpoint"),
        ({"endpoint": "http://c:4318", "protocol": "http/protobuf"}, "TRACING_ENDPOINT_PATH", "spec.tracing.endpoint"),
        ({"endpoint": "http://c:4317", "protocol": "http/json"}, "INVALID_SPEC", "spec.tracing.protocol"),
        ({"endpoint": "http://c:4317", "samplingRatio": 1.5}, "INVALID_SPEC", "spec.tracing.samplingRatio"),
        ({"endpoint": "http://c:4317", "samplingRatio": -0.1}, "INVALID_SPEC", "spec.tracing.samplingRatio"),
        ({"protocol": "grpc"}, "INVALID_SPEC", "spec.tracing.endpoint"),
        ({"endpoint": "http://c:4317", "sampler": "always_on"}, "INVALID_SPEC", "spec.tracing.sampler"),
    ],
)
def test_bad_tracing_is_refused_with_its_code_and_field(tracing: dict[str, Any], code: str, field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_deployment(document(tracing=tracing))
    assert (caught.value.code, caught.value.field) == (code, field)


def test_the_crd_schema_holds_the_same_bounds() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["tracing"]
    props = schema["properties"]
    assert schema["required"] == ["endpoint"]
    assert props["protocol"]["enum"] == ["grpc", "http/protobuf"]
    assert (props["samplingRatio"]["minimum"], props["samplingRatio"]["maximum"]) == (0, 1)
    assert props["endpoint"]["pattern"] == TRACING_ENDPOINT_PATTERN
    assert not re.match(TRACING_ENDPOINT_PATTERN, "collector:4317")


def test_vllms_flag_in_extra_args_is_refused_while_spec_tracing_sets_it(tmp_path: Path) -> None:
    doc = document(tracing=GRPC, engine={"extraArgs": ["--otlp-traces-endpoint=http://elsewhere:4317"]})
    (tmp_path / "dd.yaml").write_text(yaml.safe_dump(doc))
    assert main(["plan", "-f", str(tmp_path / "dd.yaml"), "--json"]) == 1
    without = document(engine={"extraArgs": ["--otlp-traces-endpoint=http://elsewhere:4317"]})
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(without))
    assert main(["plan", "-f", str(tmp_path / "own.yaml"), "--json"]) == 0  # the user's own, without spec.tracing


def test_plan_shows_tracing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "on.yaml").write_text(yaml.safe_dump(document(router={"enabled": True}, tracing=GRPC)))
    (tmp_path / "off.yaml").write_text(yaml.safe_dump(document()))
    assert main(["plan", "-f", str(tmp_path / "on.yaml")]) == 0
    out = capsys.readouterr().out
    assert (
        "  tracing: OTLP grpc to http://otel-collector.observability:4317, 25% of new traces (a caller's decision "
        "kept); services llama3-8b-vllm-prefill, llama3-8b-vllm-decode, llama3-8b-vllm-router; vLLM "
        "--otlp-traces-endpoint"
    ) in out
    assert main(["plan", "-f", str(tmp_path / "on.yaml"), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["tracing"] == {
        "enabled": True,
        "endpoint": GRPC["endpoint"],
        "protocol": "grpc",
        "samplingRatio": 0.25,
        "sampler": "parentbased_traceidratio",
        "services": {
            "prefill": "llama3-8b-vllm-prefill",
            "decode": "llama3-8b-vllm-decode",
            "router": "llama3-8b-vllm-router",
        },
        "vllmFlag": True,
    }
    assert main(["plan", "-f", str(tmp_path / "off.yaml"), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["tracing"] == {"enabled": False}
    assert main(["plan", "-f", str(tmp_path / "off.yaml")]) == 0
    assert "tracing:" not in capsys.readouterr().out


def test_plan_refuses_a_bad_endpoint_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(document(tracing={"endpoint": "collector:4317"})))
    assert main(["plan", "-f", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert "spec.tracing.endpoint" in err
    assert "http://HOST:PORT" in err
