"""spec.router.signTransfers: the router's token Secret (created once), mounted into the router and the decode
engines, the router's flag and the engines' variable; refused without the router and on vLLM's NixlConnector."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import Problem, Role, SpecError
from kvbridge_agent.core.contract import parse_environment
from kvbridge_agent.core.signing import load_token
from kvbridge_operator.api.names import LABEL_REVISION
from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children import transfer_token
from kvbridge_operator.children.objects.desired import optional_children
from kvbridge_operator.children.objects.router import router_token_secret
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.cli.main import main
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.actions import CreateOnce
from kvbridge_operator.controller.decide import ExistingChildren, Observed, decide
from kvbridge_operator.kube import SECRETS

ROOT = Path(__file__).parents[2]
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
SIGNING = {"enabled": True, "signTransfers": True}


def document(name: str = "synthetic/llama3-8b-hetero-tp", **spec: Any) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    found["metadata"]["namespace"] = "team-a"
    for key, value in spec.items():
        found["spec"][key] = {**found["spec"].get(key, {}), **value}
    return found


def template(dd: DisaggregatedDeployment, role: Role) -> dict[str, Any]:
    sts = stateful_set(dd, UID, role, verdict_for(dd), OperatorConfig())  # type: ignore[arg-type]
    kubernetes_validate.validate(sts, "1.30", strict=True)
    found: dict[str, Any] = sts["spec"]["template"]
    return found


def engine(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    return found


def environment(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_token_secret_is_fresh_random_hex_owned_by_the_deployment(tmp_path: Path) -> None:
    dd = parse_deployment(document(router=SIGNING))
    secret = router_token_secret(dd, UID)
    kubernetes_validate.validate(secret, "1.30", strict=True)
    assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == ("llama3-8b-router-token", "team-a")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) == 64
    int(token, 16)  # 32 random bytes in hex
    assert router_token_secret(dd, UID)["data"] != secret["data"]
    (tmp_path / "token").write_bytes(token)  # what the pods read from the mounted file
    assert load_token(str(tmp_path / "token")) == token


@pytest.mark.parametrize(
    "example", ["synthetic/llama3-8b-hetero-tp", "vllm/small-cpu-kv-aware"]
)  # synthetic; vLLM + KVBridge
def test_decode_pods_mount_the_token_and_are_told_where_prefill_pods_get_nothing(example: str) -> None:
    dd = parse_deployment(document(example, router=SIGNING))
    decode = template(dd, Role.DECODE)
    container = engine(decode)
    secret = {"secretName": f"{dd.metadata.name}-router-token", "defaultMode": 0o400}
    assert {"name": "router-token", "secret": secret} in decode["spec"]["volumes"]
    assert {"name": "router-token", "mountPath": transfer_token.TOKEN_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    variables = environment(container)
    assert variables["KVBRIDGE_TRANSFER_TOKEN_FILE"] == "/var/run/kvbridge/router-token/token"
    parsed = parse_environment({**variables, "KVBRIDGE_ENGINE_ID": "d-0", "KVBRIDGE_SIDE_CHANNEL_HOST": "10.0.0.1"})
    assert parsed.transfer_token_file == transfer_token.TOKEN_FILE
    prefill = template(dd, Role.PREFILL)
    assert "KVBRIDGE_TRANSFER_TOKEN_FILE" not in environment(engine(prefill))
    assert all(v["name"] != "router-token" for v in prefill["spec"]["volumes"])


def test_the_router_mounts_the_token_and_gets_the_flag() -> None:
    dd = parse_deployment(document(router=SIGNING))
    deployment = next(o for o in optional_children(dd, UID, OperatorConfig()) if o["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, "1.30", strict=True)
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert "--transfer-token-file=/var/run/kvbridge/router-token/token" in container["args"]
    assert container["volumeMounts"] == [
        {"name": "router-token", "mountPath": transfer_token.TOKEN_DIR, "readOnly": True}
    ]
    # the router runs as a non-root user: the Secret's root-owned file must be readable by it
    secret = {"secretName": "llama3-8b-router-token", "defaultMode": 0o444}
    assert pod["volumes"] == [{"name": "router-token", "secret": secret}]


def test_off_by_default_nothing_renders_differently() -> None:
    plain = parse_deployment(document(router={"enabled": True}))
    assert plain.spec.router.sign_transfers is False
    signing = parse_deployment(document(router=SIGNING))
    for role in Role:
        pod = template(plain, role)
        assert "KVBRIDGE_TRANSFER_TOKEN_FILE" not in environment(engine(pod))
        assert "router-token" not in json.dumps(pod)
    deployment = next(o for o in optional_children(plain, UID, OperatorConfig()) if o["kind"] == "Deployment")
    assert "router-token" not in json.dumps(deployment)
    # turning it on rolls decode (a new revision), not prefill
    before = {r: template(plain, r)["metadata"]["labels"][LABEL_REVISION] for r in Role}
    after = {r: template(signing, r)["metadata"]["labels"][LABEL_REVISION] for r in Role}
    assert before[Role.PREFILL] == after[Role.PREFILL]
    assert before[Role.DECODE] != after[Role.DECODE]


def test_signing_needs_the_router() -> None:
    with pytest.raises(SpecError) as caught:
        parse_deployment(document(router={"signTransfers": True}))
    assert (caught.value.code, caught.value.field) == ("INVALID_SPEC", "spec.router.signTransfers")
    assert "router.enabled: true" in caught.value.message


def _problem(dd: DisaggregatedDeployment) -> Problem:
    found = verdict_for(dd)
    assert isinstance(found, list)
    [problem] = [p for p in found if p.code == "VLLM_NIXL_UNSIGNED"]
    return problem


def test_nixl_cannot_check_the_signature_so_signing_is_refused_with_the_fix() -> None:
    cpu = _problem(parse_deployment(document("vllm/tiny-cpu", router=SIGNING)))
    assert cpu.field == "spec.router.signTransfers"
    assert "set spec.engine.connector: KVBridge, or spec.router.signTransfers: false" in cpu.message
    gpu_doc = document("vllm/llama3-8b-hetero-tp", router=SIGNING)
    gpu = _problem(parse_deployment(gpu_doc))  # kvbridge's connector renders on GPUs too: offered there as well
    assert gpu.message.endswith(
        "set spec.engine.connector: KVBridge, or spec.router.signTransfers: false to go without"
    )
    gpu_doc["spec"]["engine"]["connector"] = "KVBridge"
    gpu_doc["spec"]["decode"]["tensorParallelSize"] = 2  # kvbridge's connector on GPUs: equal TP sizes
    assert not isinstance(verdict_for(parse_deployment(gpu_doc)), list)
    # kvbridge's connector checks it: no problem
    kvbridge = verdict_for(parse_deployment(document("vllm/small-cpu-kv-aware", router=SIGNING)))
    assert not isinstance(kvbridge, list)


def _actions(doc: dict[str, Any]) -> list[Any]:
    body = {**doc, "metadata": {**doc["metadata"], "uid": UID, "generation": 1}}
    seen = ExistingChildren(roles=dict.fromkeys(Role), stateful_sets=dict.fromkeys(Role), pods=[])
    return decide(Observed(body, seen, OperatorConfig(), apply_children=True, now="2026-01-01T00:00:00Z")).actions


def test_the_reconcile_creates_the_token_secret_once_before_the_pods_that_mount_it() -> None:
    actions = _actions(document(router=SIGNING))
    created = [a for a in actions if isinstance(a, CreateOnce) and a.resource == SECRETS]
    assert [a.obj["metadata"]["name"] for a in created] == ["llama3-8b-side-channel", "llama3-8b-router-token"]
    first_workload = next(i for i, a in enumerate(actions) if getattr(a, "obj", {}).get("kind") == "StatefulSet")
    assert actions.index(created[1]) < first_workload
    plain = [a for a in _actions(document(router={"enabled": True})) if isinstance(a, CreateOnce)]
    assert [a.obj["metadata"]["name"] for a in plain if a.resource == SECRETS] == ["llama3-8b-side-channel"]
    # router replicas sign their reports to each other with a key of their own (decode pods never mount it)
    replicas = [a for a in _actions(document(router={"enabled": True, "replicas": 2})) if isinstance(a, CreateOnce)]
    made = {a.obj["metadata"]["name"]: a.obj for a in replicas if a.resource == SECRETS}
    assert list(made) == ["llama3-8b-side-channel", "llama3-8b-router-peers"]
    key = base64.b64decode(made["llama3-8b-router-peers"]["data"]["key"])
    assert len(bytes.fromhex(key.decode())) == 32
    assert made["llama3-8b-router-peers"]["metadata"]["ownerReferences"][0]["uid"] == UID


def test_plan_shows_whether_the_router_signs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for label, router in (("signing", SIGNING), ("plain", {"enabled": True})):
        (tmp_path / f"{label}.yaml").write_text(yaml.safe_dump(document(router=router)))
    assert main(["plan", "-f", str(tmp_path / "signing.yaml")]) == 0
    said = "router: kv-aware; decode accepts kv_transfer_params only as the router signs them (signTransfers, Secret "
    assert said + "llama3-8b-router-token)" in capsys.readouterr().out
    assert main(["plan", "-f", str(tmp_path / "plain.yaml")]) == 0
    assert "from any pod that reaches it (signTransfers off)" in capsys.readouterr().out
    assert main(["plan", "-f", str(tmp_path / "signing.yaml"), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    wanted = {"enabled": True, "policy": "kv-aware", "signTransfers": True, "tokenSecret": "llama3-8b-router-token"}
    assert entry["router"].items() >= wanted.items()
    (tmp_path / "nixl.yaml").write_text(yaml.safe_dump(document("vllm/llama3-8b-hetero-tp", router=SIGNING)))
    assert main(["plan", "-f", str(tmp_path / "nixl.yaml")]) == 1
    assert "VLLM_NIXL_UNSIGNED at spec.router.signTransfers" in capsys.readouterr().out
