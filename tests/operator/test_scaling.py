"""Per-role scaling: the effective counts (bounds, ratio), the DisaggregatedRole /scale that HPA, KEDA and
`kubectl scale` use on the emulator with the real operator, and the autoscaler examples in the docs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.crd import role_crd
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.scaling import effective_replicas
from kvbridge_operator.kube import ROLES, STATEFUL_SETS
from kvbridge_sim.cluster import Cluster, cluster

from .test_operator import example

ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]
HPA_AGENT = "horizontal-pod-autoscaler/v1.34.0"


def deployment(prefill: Obj | None = None, decode: Obj | None = None, ratio: Obj | None = None) -> Any:
    document = example("synthetic/llama3-8b-hetero-tp")
    document["spec"]["prefill"].update(prefill or {})
    document["spec"]["decode"].update(decode or {})
    if ratio is not None:
        document["spec"]["scaling"] = {"decodePerPrefill": ratio}
    return parse_deployment(document)


# -- the effective counts ----------------------------------------------------------------------------------------
def test_desired_counts_run_as_asked_within_the_bounds() -> None:
    dd = deployment({"replicas": 2, "minReplicas": 1, "maxReplicas": 4}, {"replicas": 2, "maxReplicas": 3})
    scale = effective_replicas(dd, {Role.PREFILL: 3, Role.DECODE: 9})
    assert scale.effective == {Role.PREFILL: 3, Role.DECODE: 3}
    assert scale.notes == ["decode 9 -> 3: within minReplicas 1 and maxReplicas 3"]
    assert effective_replicas(dd, {Role.PREFILL: 0, Role.DECODE: 1}).effective[Role.PREFILL] == 1


def test_a_ratio_is_kept_by_raising_the_other_role() -> None:
    dd = deployment(ratio={"min": 2, "max": 3})
    assert effective_replicas(dd, {Role.PREFILL: 3, Role.DECODE: 2}).effective == {Role.PREFILL: 3, Role.DECODE: 6}
    raised = effective_replicas(dd, {Role.PREFILL: 1, Role.DECODE: 7})
    assert raised.effective == {Role.PREFILL: 3, Role.DECODE: 7}
    assert raised.notes == ["prefill 1 -> 3: decodePerPrefill.max 3.0 with 7 decode"]


def test_a_ratio_the_maxima_forbid_is_said() -> None:
    dd = deployment(decode={"replicas": 1, "maxReplicas": 2}, ratio={"min": 2})
    scale = effective_replicas(dd, {Role.PREFILL: 4, Role.DECODE: 1})
    assert scale.effective == {Role.PREFILL: 4, Role.DECODE: 2}
    assert any("cannot be kept" in note for note in scale.notes)


@given(
    bounds=st.tuples(*(st.integers(0, 6) for _ in range(4))),
    desired=st.tuples(st.integers(0, 12), st.integers(0, 12)),
    ratio=st.one_of(
        st.none(), st.tuples(st.sampled_from([None, 0.5, 1.0, 1.5, 2.0]), st.sampled_from([None, 2.0, 3.0, 4.0]))
    ),
)
def test_effective_counts_stay_in_bounds_never_undercut_the_ask_and_keep_the_ratio_when_they_can(
    bounds: tuple[int, int, int, int], desired: tuple[int, int], ratio: tuple[float | None, float | None] | None
) -> None:
    p_min, p_span, d_min, d_span = bounds
    limits = {Role.PREFILL: (p_min, p_min + p_span), Role.DECODE: (d_min, d_min + d_span)}
    bound = None if ratio is None else {k: v for k, v in zip(("min", "max"), ratio, strict=True) if v is not None}
    dd = deployment(
        {"replicas": p_min, "minReplicas": p_min, "maxReplicas": p_min + p_span},
        {"replicas": d_min, "minReplicas": d_min, "maxReplicas": d_min + d_span},
        bound,
    )
    asked = {Role.PREFILL: desired[0], Role.DECODE: desired[1]}
    scale = effective_replicas(dd, asked)
    for role in Role:
        low, high = limits[role]
        assert low <= scale.effective[role] <= high
        assert scale.effective[role] >= min(max(asked[role], low), high)  # an ask within bounds is never lowered
    p, d = scale.effective[Role.PREFILL], scale.effective[Role.DECODE]
    at_least, at_most = (bound or {}).get("min"), (bound or {}).get("max")
    kept = (at_least is None or d >= at_least * p - 1e-9) and (at_most is None or d <= at_most * p + 1e-9)
    assert kept or any("cannot be kept" in note for note in scale.notes)


def test_replicas_outside_the_bounds_and_an_upside_down_ratio_are_refused() -> None:
    with pytest.raises(SpecError, match="replicas 5 must lie within minReplicas 1 and maxReplicas 4"):
        deployment({"replicas": 5, "maxReplicas": 4})
    with pytest.raises(SpecError, match=r"min 3\.0 is above max 2\.0"):
        deployment(ratio={"min": 3, "max": 2})


# -- on the emulator, with the real operator ------------------------------------------------------------------------
async def scale_role(c: Cluster, name: str, replicas: int, agent: str = HPA_AGENT) -> None:
    """What HPA, KEDA (through its HPA) and `kubectl scale` do: write the target's /scale."""
    from kvbridge_operator.kube import KubeClient

    async with KubeClient.for_url(c.url, user_agent=agent) as scaler:
        scale = await scaler.get(ROLES, "default", name, "scale")
        assert scale is not None, f"no /scale on {name}"
        await scaler.patch(ROLES, "default", name, {"spec": {"replicas": replicas}}, "scale")


def replicas(c: Cluster, name: str) -> int:
    found = c.api.find("statefulsets", "default", name)
    assert found is not None
    return int(found["spec"]["replicas"])


async def test_an_autoscaler_scales_a_role_and_the_operator_never_reverts_it() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.api.find("disaggregatedroles", "default", "llama3-8b-decode") is not None)
        role = c.api.find("disaggregatedroles", "default", "llama3-8b-decode")
        assert role is not None
        assert role["spec"] == {"deployment": "llama3-8b", "role": "decode", "replicas": 1}
        await c.wait(
            lambda: (
                (c.api.find("disaggregatedroles", "default", "llama3-8b-decode") or {})
                .get("status", {})
                .get("selector")
                == "kvbridge.io/deployment=llama3-8b,kvbridge.io/role=decode"
            )
        )
        await scale_role(c, "llama3-8b-decode", 5)
        await c.wait(lambda: replicas(c, "llama3-8b-decode") == 5, what="the StatefulSet follows the autoscaler")
        scaled = c.api.find("disaggregatedroles", "default", "llama3-8b-decode")
        assert scaled is not None
        owners = {e["manager"]: e["fieldsV1"] for e in scaled["metadata"]["managedFields"]}
        assert owners["horizontal-pod-autoscaler"] == {"f:spec": {"f:replicas": {}}}
        await c.run_pods("llama3-8b", "prefill")
        await c.run_pods("llama3-8b", "decode")
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["decode"]["ready"] == "5/5")
        status = c.deployment("llama3-8b")["status"]["decode"]
        assert (status["desiredReplicas"], status["replicas"], status["readyReplicas"]) == (5, 5, 5)
        await c.wait(
            lambda: any(e["reason"] == "Scaled" and "decode: 1 -> 5" in e["message"] for e in c.events("llama3-8b")),
            what="the Scaled event",
        )
        # a spec change re-applies every child (a full reconcile, as the resync does): the autoscaler's 5 stays
        await c.patch_spec("llama3-8b", {"decode": {"template": {"metadata": {"annotations": {"team": "a"}}}}})
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["observedGeneration"] == 2)
        assert c.deployment("llama3-8b")["status"]["decode"]["replicas"] == 5
        assert replicas(c, "llama3-8b-decode") == 5 + 1  # the autoscaler's 5, and one surge pod of the rollout
        assert c.api.find("disaggregatedroles", "default", "llama3-8b-decode")["spec"]["replicas"] == 5  # type: ignore[index]
        # the deployment's own replicas changed: a person's explicit choice, written to the role once
        await c.patch_spec("llama3-8b", {"decode": {"replicas": 3}})
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["decode"]["replicas"] == 3, what="the spec's 3")
        assert replicas(c, "llama3-8b-decode") == 3 + 1  # still rolling the annotation change, one surge pod
        role = c.api.find("disaggregatedroles", "default", "llama3-8b-decode")
        assert role is not None
        assert role["spec"]["replicas"] == 3


async def test_bounds_and_the_ratio_hold_when_one_role_scales() -> None:
    document = example("synthetic/llama3-8b-hetero-tp")
    document["spec"]["prefill"].update({"replicas": 1, "maxReplicas": 3})
    document["spec"]["decode"].update({"replicas": 2, "maxReplicas": 8})  # 2 per prefill from the start
    document["spec"]["scaling"] = {"decodePerPrefill": {"min": 2}}
    async with cluster() as c:
        await c.apply(document)
        await c.wait(lambda: c.api.find("statefulsets", "default", "llama3-8b-prefill") is not None)
        await scale_role(c, "llama3-8b-prefill", 6)  # above maxReplicas 3
        await c.wait(lambda: replicas(c, "llama3-8b-prefill") == 3, what="prefill held at maxReplicas")
        await c.wait(lambda: replicas(c, "llama3-8b-decode") == 6, what="decode raised to keep 2 per prefill")
        await c.wait(
            lambda: (
                (c.api.find("disaggregatedroles", "default", "llama3-8b-prefill") or {})
                .get("status", {})
                .get("effectiveReplicas")
                == 3
            )
        )
        role = c.api.find("disaggregatedroles", "default", "llama3-8b-prefill")
        assert role is not None
        assert role["spec"]["replicas"] == 6  # the autoscaler's ask is kept, not rewritten
        assert role["status"]["effectiveReplicas"] == 3
        assert "within minReplicas 1 and maxReplicas 3" in role["status"]["message"]

        def decode() -> Obj:
            return c.api.find("disaggregatedroles", "default", "llama3-8b-decode") or {}

        await c.wait(lambda: decode()["status"]["effectiveReplicas"] == 6, what="decode's status says 6")
        assert decode()["spec"]["replicas"] == 2  # its own ask is kept


async def test_each_role_gets_a_disruption_budget() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: len(c.api.objects_of("poddisruptionbudgets")) == 2)
        for budget in c.api.objects_of("poddisruptionbudgets"):
            role = budget["metadata"]["labels"]["kvbridge.io/role"]
            assert budget["spec"] == {
                "maxUnavailable": 1,
                "selector": {"matchLabels": {"kvbridge.io/deployment": "llama3-8b", "kvbridge.io/role": role}},
            }
        assert STATEFUL_SETS.plural == "statefulsets"


# -- the documented autoscalers ----------------------------------------------------------------------------------------
def documents(name: str) -> list[Obj]:
    return list(yaml.safe_load_all((ROOT / "examples" / "autoscaling" / name).read_text()))


def vllm_metric_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None, "vLLM is not installed: make setup installs its CPU build"
    assert spec.origin is not None
    text = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    return set(re.findall(r'name="(vllm:[a-z_]+)"', text))


#: the deployment the autoscaling examples scale: vLLM engines, whose metrics they read
SCALED = yaml.safe_load((ROOT / "examples" / "vllm" / "llama3-8b-hetero-tp.yaml").read_text())
ROLE_NAMES = {f"{SCALED['metadata']['name']}-{role.value}": role for role in Role}


def test_the_autoscaling_examples_scale_a_vllm_deployment() -> None:
    assert SCALED["spec"]["engine"]["kind"] == "VLLM"  # the metrics they read are vLLM's
    for name in ("hpa.yaml", "keda-scaledobject.yaml"):
        assert SCALED["metadata"]["name"] in (ROOT / "examples" / "autoscaling" / name).read_text()


def test_the_role_resource_is_a_scale_target() -> None:
    version = role_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    kubernetes_validate.validate(role_crd(), "1.30", strict=True)


@pytest.mark.vllm  # the metric names are read from vLLM's sources
def test_the_hpa_example_is_valid_and_targets_each_role_on_vllms_metrics() -> None:
    metrics = vllm_metric_names()
    hpas = documents("hpa.yaml")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == set(ROLE_NAMES)
    for hpa in hpas:
        kubernetes_validate.validate(hpa, "1.30", strict=True)
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("kvbridge.io/v1alpha1", "DisaggregatedRole")
        for metric in hpa["spec"]["metrics"]:
            exposed = metric["pods"]["metric"]["name"]  # the adapter's name: vllm:x served as vllm_x
            assert exposed.replace("vllm_", "vllm:", 1) in metrics, exposed


@pytest.mark.vllm  # the metric names are read from vLLM's sources
def test_the_keda_example_has_what_kedas_schema_requires_and_queries_one_role_each() -> None:
    metrics = vllm_metric_names()
    objects = documents("keda-scaledobject.yaml")
    assert {o["spec"]["scaleTargetRef"]["name"] for o in objects} == set(ROLE_NAMES)
    for scaled in objects:  # KEDA's ScaledObject schema: spec.scaleTargetRef.name and spec.triggers[].type/metadata
        assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
        target = scaled["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("kvbridge.io/v1alpha1", "DisaggregatedRole")
        for trigger in scaled["spec"]["triggers"]:
            assert trigger["type"] == "prometheus"
            meta = trigger["metadata"]
            assert all(isinstance(v, str) for v in meta.values())  # a map of strings in KEDA's schema
            assert {"serverAddress", "query", "threshold"} <= set(meta)
            float(meta["threshold"])
            assert set(re.findall(r"vllm:[a-z_]+", meta["query"])) <= metrics
            pods = re.search(r'pod=~"([^"]+)"', meta["query"])
            assert pods is not None
            role = ROLE_NAMES[target["name"]]
            other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
            assert re.fullmatch(pods.group(1), f"{SCALED['metadata']['name']}-{role.value}-0")
            assert not re.fullmatch(pods.group(1), f"{SCALED['metadata']['name']}-{other.value}-0")
