"""The Helm chart rendered in-process (helm-python-sdk): valid objects, least privilege, strict values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from kvbridge_operator.api.rbac import REQUIRED

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "kvbridge"
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespace-scope": {"watch": {"scope": "Namespace"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "cpu-mode-custom-images": {
        "gpu": {"cpuMode": True, "resourceName": "amd.com/gpu", "perNode": 8},
        "image": {"repository": "registry.local/kvbridge-operator", "tag": "dev"},
        "synthetic": {"image": "registry.local/kvbridge-agent:dev", "numBlocks": 1024},
        "vllm": {
            "kvbridgeImage": "registry.local/vllm-engine:dev",
            "kvbridgeCpuImage": "registry.local/vllm-engine:dev-cpu",
        },
        "agent": {"podNetworks": ["10.244.0.0/16", "fd00:10:244::/56"]},
    },
    "three-namespaces": {"watch": {"scope": "Namespace", "namespaces": ["team-a", "team-b", "team-c"]}},
    "no-metrics-existing-sa": {"metrics": {"enabled": False}, "serviceAccount": {"create": False, "name": "ops"}},
    "monitoring": {
        "monitoring": {
            "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "dashboard": {"enabled": True, "namespace": "grafana"},
        }
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values, name="kvbridge", namespace="kvbridge-system", is_install=True)
    return [
        doc
        for name, text in sorted(manifests.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_every_rendered_object_validates_strictly(values: dict[str, Any]) -> None:
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"  # not a built-in schema
            continue
        if obj["kind"] == "PodMonitor":  # not a built-in schema: checked in test_the_pod_monitor_...
            continue
        kubernetes_validate.validate(obj, "1.30", strict=True)
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvbridge"
        assert labels["app.kubernetes.io/instance"] == "kvbridge"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        found.setdefault(obj["kind"], []).append(obj)
    return found


def test_rbac_grants_exactly_what_the_operator_calls_and_no_wildcards() -> None:
    wanted = {(group, resource, verb) for group, resource, verbs in REQUIRED for verb in verbs}
    for values in VALUE_SETS.values():
        kinds = by_kind(render(values))
        roles = kinds.get("ClusterRole", []) + kinds.get("Role", [])
        assert roles
        for role in roles:
            granted = {
                (g, r, v)
                for rule in role["rules"]
                for g in rule["apiGroups"]
                for r in rule["resources"]
                for v in rule["verbs"]
            }
            assert granted == wanted
            assert not any("*" in item for item in granted for item in item)


def test_watch_scopes() -> None:
    cluster = by_kind(render({}))
    assert {"ClusterRole", "ClusterRoleBinding"} <= set(cluster)
    assert "Role" not in cluster
    namespaced = by_kind(render({"watch": {"scope": "Namespace"}}))
    assert "ClusterRole" not in namespaced
    assert "ClusterRoleBinding" not in namespaced
    [binding] = namespaced["RoleBinding"]
    assert binding["metadata"]["namespace"] == "kvbridge-system"
    [deployment] = namespaced["Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVBRIDGE_OPERATOR_NAMESPACES"] == "kvbridge-system"
    cluster_env = cluster["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "KVBRIDGE_OPERATOR_NAMESPACES" not in {e["name"] for e in cluster_env}


def test_several_watched_namespaces_get_a_role_each_and_reach_the_operator() -> None:
    from kvbridge_operator.config import OperatorConfig

    kinds = by_kind(render(VALUE_SETS["three-namespaces"]))
    assert "ClusterRole" not in kinds
    assert "ClusterRoleBinding" not in kinds
    wanted = ["team-a", "team-b", "team-c"]
    assert sorted(r["metadata"]["namespace"] for r in kinds["Role"]) == wanted
    assert sorted(b["metadata"]["namespace"] for b in kinds["RoleBinding"]) == wanted
    for binding in kinds["RoleBinding"]:
        assert binding["subjects"][0]["namespace"] == "kvbridge-system"
    env = {e["name"]: e["value"] for e in kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert OperatorConfig.from_env(env).namespaces == tuple(wanted)


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        (
            {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
            "metrics.serviceMonitor.enabled=true needs metrics.enabled=true",
        ),
        ({"watch": {"namespaces": ["team-a"]}}, "watch.namespaces is set but watch.scope is Cluster"),
    ],
)
def test_values_that_contradict_each_other_are_refused_with_a_reason(values: dict[str, Any], reason: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match=reason.replace(".", r"\.")):
        chart.render(values, name="kvbridge", namespace="kvbridge-system")


def test_operator_deployment_is_one_restricted_replica() -> None:
    [deployment] = by_kind(render({}))["Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["securityContext"] == {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["image"] == "ghcr.io/kvbridge/kvbridge-operator:0.1.0"
    assert container["resources"]["limits"]["memory"] == "512Mi"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KVBRIDGE_OPERATOR_SYNTHETIC_IMAGE"] == "ghcr.io/kvbridge/kvbridge-agent:0.1.0"
    assert env["KVBRIDGE_OPERATOR_KVBRIDGE_VLLM_IMAGE"] == "ghcr.io/kvbridge/vllm-engine:0.1.0"
    assert env["KVBRIDGE_OPERATOR_KVBRIDGE_VLLM_CPU_IMAGE"] == "ghcr.io/kvbridge/vllm-engine:0.1.0-cpu"
    assert env["KVBRIDGE_OPERATOR_GPU_RESOURCE"] == "nvidia.com/gpu"
    assert env["KVBRIDGE_OPERATOR_METRICS_PORT"] == "8081"


def test_the_former_agent_values_are_still_read() -> None:
    """Issue 57: agent.image and agent.numBlocks became synthetic.image and synthetic.numBlocks; a values file of the
    former names keeps doing what it did (they win where set), and what the chart renders the operator reads."""
    from kvbridge_operator.config import OperatorConfig

    values = {"agent": {"image": "old/agent:1", "numBlocks": 64}, "synthetic": {"image": "new/synthetic:2"}}
    [deployment] = by_kind(render(values))["Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["KVBRIDGE_OPERATOR_SYNTHETIC_IMAGE"], env["KVBRIDGE_OPERATOR_SYNTHETIC_NUM_BLOCKS"]) == (
        "old/agent:1",
        "64",
    )
    config = OperatorConfig.from_env(env)
    assert (config.synthetic_image, config.synthetic_num_blocks) == ("old/agent:1", 64)


def test_values_reach_the_operator() -> None:
    [deployment] = by_kind(render(VALUE_SETS["cpu-mode-custom-images"]))["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["image"] == "registry.local/kvbridge-operator:dev"
    assert env["KVBRIDGE_OPERATOR_SYNTHETIC_IMAGE"] == "registry.local/kvbridge-agent:dev"
    assert env["KVBRIDGE_OPERATOR_KVBRIDGE_VLLM_IMAGE"] == "registry.local/vllm-engine:dev"
    assert env["KVBRIDGE_OPERATOR_KVBRIDGE_VLLM_CPU_IMAGE"] == "registry.local/vllm-engine:dev-cpu"
    assert env["KVBRIDGE_OPERATOR_CPU_MODE"] == "true"
    assert env["KVBRIDGE_OPERATOR_SYNTHETIC_NUM_BLOCKS"] == "1024"
    assert env["KVBRIDGE_OPERATOR_GPU_RESOURCE"] == "amd.com/gpu"
    assert env["KVBRIDGE_OPERATOR_GPUS_PER_NODE"] == "8"
    assert env["KVBRIDGE_OPERATOR_POD_NETWORKS"] == "10.244.0.0/16,fd00:10:244::/56"
    default = {
        e["name"]: e["value"]
        for e in by_kind(render({}))["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert default["KVBRIDGE_OPERATOR_VLLM_IMAGE"] == "vllm/vllm-openai:v0.32.0"
    assert default["KVBRIDGE_OPERATOR_VLLM_CPU_IMAGE"] == "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
    assert default["KVBRIDGE_OPERATOR_ROUTING_SIDECAR_IMAGE"] == ""  # no sidecar unless asked for
    assert default["KVBRIDGE_OPERATOR_GPUS_PER_NODE"] == "0"  # fit not checked unless the cluster is described
    assert "KVBRIDGE_OPERATOR_POD_NETWORKS" not in default  # decode reaches any host unless the networks are named
    assert "KVBRIDGE_OPERATOR_SERVICE_DOMAIN" not in default  # the operator's own default: svc
    for domain in ("", "svc.cluster.local"):  # empty: decode not restricted to the prefill Service's addresses
        deployment = by_kind(render({"agent": {"serviceDomain": domain}}))["Deployment"][0]
        env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["KVBRIDGE_OPERATOR_SERVICE_DOMAIN"] == domain
    sidecar = {
        "vllm": {
            "routingSidecar": {
                "image": "ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0",
                "args": ["--connector=nixlv2", "--secure-proxy=true", "--allowlist=a,b"],
            }
        }
    }
    [operator] = by_kind(render(sidecar))["Deployment"]
    env = {e["name"]: e["value"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVBRIDGE_OPERATOR_ROUTING_SIDECAR_IMAGE"] == "ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0"
    from kvbridge_operator.config import OperatorConfig

    config = OperatorConfig.from_env(env)  # what the operator makes of the chart's variables
    assert config.routing_sidecar_image == "ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0"
    # one argument with a comma stays one argument (the chart passes a JSON array)
    assert config.routing_sidecar_args == ("--connector=nixlv2", "--secure-proxy=true", "--allowlist=a,b")
    assert config.vllm_image == "vllm/vllm-openai:v0.32.0"
    assert config.vllm_cpu_image == "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
    kinds = by_kind(render(VALUE_SETS["no-metrics-existing-sa"]))
    assert "ServiceAccount" not in kinds
    assert "Service" not in kinds
    assert kinds["Deployment"][0]["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


@pytest.mark.parametrize(
    "bad",
    [
        {"watch": {"scope": "Galaxy"}},
        {"unknownKey": 1},
        {"image": {"repository": "x", "pullPolicy": "Sometimes"}},
        {"agent": {"numBlocks": 0}},
        {"synthetic": {"numBlocks": 0}},
        {"synthetic": {"name": "x"}},
        {"agent": {"podNetworks": ["pods.example"]}},
        {"agent": {"serviceDomain": "svc/cluster"}},
        {"gpu": {"cpuMode": "yes"}},
        {"metrics": {"port": 70000}},
        {"metrics": {"serviceMonitor": {"interval": "often"}}},
        {"vllm": {"image": ""}},
        {"watch": {"scope": "Namespace", "namespaces": ["Team_A"]}},
        {"watch": {"scope": "Namespace", "namespaces": ["a", "a"]}},
    ],
)
def test_values_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmError):
        chart.render(bad, name="kvbridge", namespace="kvbridge-system")


def test_lint_passes_strictly() -> None:
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_crds_are_a_byte_copy_of_the_generated_ones() -> None:
    top = sorted((ROOT / "crds").glob("*.yaml"))
    chart = sorted((CHART / "crds").glob("*.yaml"))
    assert [p.name for p in top] == [p.name for p in chart]
    for a, b in zip(top, chart, strict=True):
        assert a.read_bytes() == b.read_bytes(), f"{b} differs from {a}: run `make crds`"


def test_chart_and_app_versions() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert meta["version"]
    assert meta["appVersion"]
    assert meta["kubeVersion"].startswith(">=")


def test_the_pod_monitor_scrapes_every_kvbridge_pod_by_its_port_names() -> None:
    """Engines, the synthetic engine and the router name their HTTP port ``http`` (a decode vLLM behind the routing
    sidecar: ``vllm``); the PodMonitor selects every pod the operator labels with its deployment."""
    (monitor,) = by_kind(render(VALUE_SETS["monitoring"]))["PodMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["selector"] == {"matchExpressions": [{"key": "kvbridge.io/deployment", "operator": "Exists"}]}
    assert [e["port"] for e in spec["podMetricsEndpoints"]] == ["http", "vllm"]
    targets = {r["targetLabel"] for r in spec["podMetricsEndpoints"][0]["relabelings"]}
    assert {"deployment", "role"} <= targets
    assert "PodMonitor" not in by_kind(render({}))


def _exported_metric_names() -> set[str]:
    """Every series name kvbridge and vLLM export: the agent's and router's registries as they render, the
    connector's ``vllm:kvbridge_*`` and vLLM's own ``vllm:*`` names as their sources declare them."""
    import importlib.util
    import re

    from prometheus_client import CollectorRegistry

    from kvbridge_agent.transfer.metrics import AgentMetrics
    from kvbridge_router.metrics import RouterMetrics

    names: set[str] = set()
    registries: list[CollectorRegistry] = [AgentMetrics("decode", "e").registry, RouterMetrics().registry]
    for registry in registries:
        for family in registry.collect():
            names |= {family.name, f"{family.name}_total", f"{family.name}_bucket"}
    sources = [ROOT / "agent" / "kvbridge_agent" / "vllm_connector" / "stats.py"]
    vllm = importlib.util.find_spec("vllm")
    if vllm is not None and vllm.origin is not None:
        package = Path(vllm.origin).parent
        sources += [
            package / "v1" / "metrics" / "loggers.py",
            *(package / "distributed" / "kv_transfer").rglob("nixl/*.py"),
        ]
    for source in sources:
        for name in re.findall(r'"(vllm:[a-z_]+)"', source.read_text()):
            names |= {name, f"{name}_total", f"{name}_bucket"}
    return names


@pytest.mark.vllm  # the vLLM series are looked up in vLLM's own sources
def test_the_dashboard_is_valid_json_and_plots_only_series_that_exist() -> None:
    import json
    import re

    (config_map,) = by_kind(render(VALUE_SETS["monitoring"]))["ConfigMap"]
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["kvbridge-pd.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "kvbridge-pd.json").read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    for wanted in ("KV transfer time", "Failed transfers by code", "Time to first token", "Queues", "Expired leases"):
        assert any(t.startswith(wanted) for t in titles), titles
    exported = _exported_metric_names()
    assert "vllm:num_requests_waiting" in exported  # the vLLM sources were read
    plotted = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            plotted |= set(
                re.findall(r"((?:vllm:)?[a-z_]+_(?:seconds_bucket|total|requests|waiting|running))\b", target["expr"])
            )
    assert len(plotted) >= 15
    assert plotted <= exported, plotted - exported


def notes(values: dict[str, Any]) -> str:
    chart = helm.Chart.load(str(CHART))
    rendered = chart.render(values, name="kvbridge", namespace="kvbridge-system", is_install=True)
    return rendered["kvbridge/templates/NOTES.txt"]


NOTES_CASES = [
    ({}, "watches DisaggregatedDeployments in all namespaces"),
    ({"watch": {"scope": "Namespace"}}, "only in namespace kvbridge-system\n"),
    ({"watch": {"scope": "Namespace", "namespaces": ["team-a", "team-b"]}}, "only in namespaces team-a, team-b\n"),
]


@pytest.mark.parametrize(("values", "says"), NOTES_CASES)
def test_the_notes_say_which_namespaces_are_watched_and_how_to_change_it(values: dict[str, Any], says: str) -> None:
    text = notes(values)
    assert says in text
    assert "helm upgrade kvbridge <chart> -n kvbridge-system --reuse-values --set watch.scope=" in text
    if values:
        listed = values["watch"].get("namespaces", ["kvbridge-system"])
        assert f"--set 'watch.namespaces={{{','.join(listed)},another}}'" in text


def test_the_notes_commands_render_values_the_chart_accepts() -> None:
    """What the notes tell to --set (helm's own --set parser) renders, and the notes then say so."""
    some = helm.parse_set_string("watch.scope=Namespace,watch.namespaces={team-a,team-b}")
    assert "only in namespaces team-a, team-b\n" in notes(some)
    every = helm.parse_set_string("watch.scope=Cluster,watch.namespaces=null")
    assert "in all namespaces" in notes({"watch": {"scope": "Namespace", "namespaces": ["a"]}} | every)
