"""The emulated API server's server-side apply and scale subresource: what the operator's SSA relies on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest

from kvbridge_operator.kube import STATEFUL_SETS, ApiError, KubeClient
from kvbridge_sim.apiserver import RealisticKubernetes

Obj = dict[str, Any]


@pytest.fixture
async def api() -> AsyncIterator[tuple[RealisticKubernetes, KubeClient, KubeClient]]:
    async with RealisticKubernetes() as emulator, kmock.Server(emulator) as server:
        url = str(server.url)
        async with (
            KubeClient.for_url(url, user_agent="kvbridge-operator") as ours,
            KubeClient.for_url(url, user_agent="horizontal-pod-autoscaler/v1.34") as theirs,
        ):
            yield emulator, ours, theirs


def stateful_set(replicas: int | None = 2, **labels: str) -> Obj:
    template = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [{"name": "c"}]}}
    spec: Obj = {"selector": {"matchLabels": {"app": "x"}}, "serviceName": "x", "template": template}
    if replicas is not None:
        spec["replicas"] = replicas
    meta = {"name": "x", "namespace": "default", "labels": {"app": "x", **labels}}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


def managers(obj: Obj) -> dict[str, str]:
    return {e["manager"]: e["operation"] for e in obj["metadata"]["managedFields"]}


async def test_apply_creates_the_object_and_records_its_manager(api: Any) -> None:
    _emulator, ours, _theirs = api
    created = await ours.apply(STATEFUL_SETS, stateful_set())
    assert created["metadata"]["uid"]
    assert created["spec"]["replicas"] == 2
    assert managers(created) == {"kvbridge-operator": "Apply"}
    fields = created["metadata"]["managedFields"][0]["fieldsV1"]
    assert "f:replicas" in fields["f:spec"]
    assert "f:app" in fields["f:metadata"]["f:labels"]


async def test_apply_leaves_what_other_managers_set_alone(api: Any) -> None:
    _emulator, ours, theirs = api
    await ours.apply(STATEFUL_SETS, stateful_set(replicas=None))  # kvbridge does not decide the replicas
    await theirs.patch(STATEFUL_SETS, "default", "x", {"spec": {"replicas": 7}}, "scale")
    await theirs.patch(STATEFUL_SETS, "default", "x", {"metadata": {"annotations": {"team": "search"}}})
    again = await ours.apply(STATEFUL_SETS, stateful_set(replicas=None, tier="gold"))
    assert again["spec"]["replicas"] == 7
    assert again["metadata"]["annotations"] == {"team": "search"}
    assert again["metadata"]["labels"] == {"app": "x", "tier": "gold"}
    assert managers(again) == {"kvbridge-operator": "Apply", "horizontal-pod-autoscaler": "Update"}


async def test_a_field_an_applier_leaves_out_is_removed_unless_another_manager_owns_it(api: Any) -> None:
    _emulator, ours, theirs = api
    await ours.apply(STATEFUL_SETS, stateful_set(tier="gold", zone="a"))
    await theirs.patch(STATEFUL_SETS, "default", "x", {"metadata": {"labels": {"zone": "b"}}})  # zone is theirs now
    after = await ours.apply(STATEFUL_SETS, stateful_set())
    assert after["metadata"]["labels"] == {"app": "x", "zone": "b"}  # tier removed, zone kept


async def test_an_apply_that_contradicts_another_manager_conflicts_unless_forced(api: Any) -> None:
    emulator, ours, theirs = api
    await ours.apply(STATEFUL_SETS, stateful_set(replicas=None))
    await theirs.patch(STATEFUL_SETS, "default", "x", {"spec": {"replicas": 5}}, "scale")
    conflicting = stateful_set(replicas=3)
    with pytest.raises(ApiError) as refused:  # the operator always forces; a raw request shows the conflict
        await ours._request(
            "patch",
            "PATCH",
            STATEFUL_SETS,
            STATEFUL_SETS.path("default", "x"),
            body=conflicting,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": "kvbridge-operator"},
        )
    assert refused.value.status == 409
    assert 'conflict with "horizontal-pod-autoscaler": .spec.replicas' in str(refused.value)
    forced = await ours.apply(STATEFUL_SETS, conflicting)
    assert forced["spec"]["replicas"] == 3
    assert managers(forced) == {"kvbridge-operator": "Apply"}  # the field moved; the autoscaler owns nothing now
    assert emulator.find("statefulsets", "default", "x")["spec"]["replicas"] == 3


async def test_an_apply_that_changes_nothing_writes_nothing(api: Any) -> None:
    _emulator, ours, _theirs = api
    first = await ours.apply(STATEFUL_SETS, stateful_set())
    second = await ours.apply(STATEFUL_SETS, stateful_set())
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert second["metadata"]["generation"] == 1


async def test_the_scale_subresource_reads_and_writes_the_replicas(api: Any) -> None:
    _emulator, ours, theirs = api
    await ours.apply(STATEFUL_SETS, stateful_set(replicas=2))
    scale = await theirs.get(STATEFUL_SETS, "default", "x", "scale")
    assert scale is not None
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["selector"]) == ("Scale", 2, "app=x")
    await theirs.patch(STATEFUL_SETS, "default", "x", {"spec": {"replicas": 4}}, "scale")
    assert (await theirs.get(STATEFUL_SETS, "default", "x"))["spec"]["replicas"] == 4
    with pytest.raises(ApiError) as bad:
        await theirs.patch(STATEFUL_SETS, "default", "x", {"spec": {"replicas": -1}}, "scale")
    assert bad.value.status == 422
