"""``kvbridge plan --json`` is enough to run each role outside Kubernetes: the process built from the JSON alone
(vllm_engines.plan_json_pod) is the one built from the pod template the operator renders, for both connectors.
tests/vllm starts its NixlConnector and KVBridgeConnector TP-1 engines from the JSON, and their tokens are
compared with a single engine's there."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_agent.core import Role
from kvbridge_sim import pods
from kvbridge_sim.vllm_engines import MODEL_NAME, deployment, plan_json, plan_json_pod, rendered_template


@pytest.mark.parametrize("connector", ["Nixl", "KVBridge"])
@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_the_json_alone_starts_the_process_the_pod_runs(tmp_path: Path, connector: str, role: Role) -> None:
    document = deployment(f"json-{connector.lower()}", 1, connector=connector)
    models = {MODEL_NAME: "/models/tiny"}
    from_json = plan_json_pod(
        plan_json(document, tmp_path), role, "pod-0", "127.0.3.1", tmp_path, models=models, cpus=(0,)
    )
    from_pod = pods.local_pod(
        rendered_template(document, role), "pod-0", "127.0.3.1", tmp_path, models=models, cpus=(0,)
    )
    assert from_json.argv == from_pod.argv
    assert from_json.env == from_pod.env
    assert (from_json.http_port, from_json.health_path) == (from_pod.http_port, from_pod.health_path)
    assert from_json.env["KVBRIDGE_ENGINE_ID"] == "pod-0"
    assert "/models/tiny" in from_json.argv
