"""The local runner has no cluster DNS: a decode pod told its prefill Service (``KVBRIDGE_PREFILL_SERVICE``, which
the operator renders by default) is told the local pods' network instead, both where the demo's runner starts a pod
from its template and where an engine starts from ``kvbridge plan --json``; everything else stays as rendered."""

from __future__ import annotations

from pathlib import Path

from kvbridge_agent.core import Role
from kvbridge_agent.core.admission import PrefillHosts
from kvbridge_agent.core.contract import parse_environment
from kvbridge_sim import pods
from kvbridge_sim.vllm_engines import MODEL_NAME, deployment, plan_json, plan_json_pod, rendered_template


def test_a_local_decode_checks_prefill_hosts_against_the_loopback_pods_not_cluster_dns(tmp_path: Path) -> None:
    document = deployment("json-kvbridge", 1, connector="KVBridge")
    template = rendered_template(document, Role.DECODE)
    rendered = pods.resolve_env(pods.engine_container(template), "pod-0", "127.0.3.1")
    assert rendered["KVBRIDGE_PREFILL_SERVICE"] == "json-kvbridge-prefill.default.svc"  # what a cluster runs
    models = {MODEL_NAME: "/models/tiny"}
    local = pods.local_pod(template, "pod-0", "127.0.3.1", tmp_path, models=models)
    from_json = plan_json_pod(plan_json(document, tmp_path), Role.DECODE, "pod-0", "127.0.3.1", tmp_path, models=models)
    for env in (local.env, from_json.env):
        assert "KVBRIDGE_PREFILL_SERVICE" not in env
        assert env["KVBRIDGE_PREFILL_HOSTS"] == "127.0.0.0/8"
        assert PrefillHosts(parse_environment(env).prefill_hosts or ()).admits("127.0.3.2")  # another local pod
    assert {k: v for k, v in local.env.items() if k != "KVBRIDGE_PREFILL_HOSTS"} == {
        k: v for k, v in rendered.items() if k != "KVBRIDGE_PREFILL_SERVICE"
    }
    # pods.local_network leaves alone what names no Service, and podNetworks the operator rendered
    assert pods.local_network({"KVBRIDGE_PREFILL_HOSTS": "10.0.0.0/8"}) == {"KVBRIDGE_PREFILL_HOSTS": "10.0.0.0/8"}
    named = {"KVBRIDGE_PREFILL_SERVICE": "x.ns.svc", "KVBRIDGE_PREFILL_HOSTS": "127.0.0.0/8,10.0.0.0/8"}
    assert pods.local_network(named) == {"KVBRIDGE_PREFILL_HOSTS": "127.0.0.0/8,10.0.0.0/8"}
