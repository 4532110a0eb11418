"""Issue 59: the emulated API's verbs answer as a Kubernetes API server answers them, where a user (``kubectl``, a
client of their own) would see a difference: create (201, ``dryRun``, a namespace that does not match), update
(PUT: a replace; ``resourceVersion`` checked, and required for a custom resource), patch (strategic merge patches
merge lists by key on built-in kinds and are refused with 415 on custom resources; unknown types 415), delete
(``dryRun``, preconditions, the garbage collector's cascade or orphaning) and deletecollection."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_sim.local_api import emulated_api
from kvbridge_sim.patches import strategic_merge
from kvbridge_sim.selectors import merge_patch

Obj = dict[str, Any]
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
STATEFULSETS = "/apis/apps/v1/namespaces/default/statefulsets"
PODS = "/api/v1/namespaces/default/pods"
DEPLOYMENTS = "/apis/kvbridge.io/v1alpha1/namespaces/default/disaggregateddeployments"
JSON, MERGE, STRATEGIC = "application/json", "application/merge-patch+json", "application/strategic-merge-patch+json"


class Api:
    """Raw HTTP requests to the emulated API (as kubectl sends them): the status and the JSON answer."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session

    async def __call__(
        self, method: str, path: str, body: Any = None, content_type: str = JSON, **params: str
    ) -> tuple[int, Obj]:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type}
        async with self.session.request(method, self.url + path, data=data, headers=headers, params=params) as r:
            return r.status, await r.json(content_type=None)


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    async with emulated_api() as (_emulator, url, _client), aiohttp.ClientSession() as session:
        yield Api(url, session)


def config_map(name: str = "c", **labels: str) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


def stateful_set(owner: Obj | None = None) -> Obj:
    containers = [
        {"name": "engine", "image": "a", "command": ["serve"], "env": [{"name": "X", "value": "1"}]},
        {"name": "sidecar", "image": "b"},
    ]
    meta: Obj = {"name": "s"}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "X", "name": "o", "uid": owner["metadata"]["uid"]}]
    template = {"metadata": {"labels": {"app": "s"}}, "spec": {"containers": containers}}
    spec = {"replicas": 1, "selector": {"matchLabels": {"app": "s"}}, "template": template}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


def deployment() -> Obj:
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "x"},
        "spec": {"engine": {"kind": "Agent"}, "model": {"name": "m", "numLayers": 2, "numKVHeads": 4, "headDim": 64}},
    }


async def test_create_answers_201_and_a_dry_run_stores_nothing(api: Api) -> None:
    assert (await api("POST", CONFIGMAPS, config_map(), dryRun="All"))[0] == 201
    assert (await api("GET", f"{CONFIGMAPS}/c"))[0] == 404
    status, created = await api("POST", CONFIGMAPS, config_map())
    assert status == 201
    assert created["metadata"]["uid"]
    status, again = await api("POST", CONFIGMAPS, config_map())
    assert (status, again["reason"], again["message"]) == (409, "AlreadyExists", 'configmaps "c" already exists')
    assert again["details"] == {"name": "c", "group": "", "kind": "configmaps"}  # not a Python traceback
    elsewhere = {**config_map("d"), "metadata": {"name": "d", "namespace": "other"}}
    status, refused = await api("POST", CONFIGMAPS, elsewhere)
    assert (status, refused["reason"]) == (400, "BadRequest")
    assert "does not match the namespace sent on the request" in refused["message"]


async def test_put_replaces_the_object_checks_its_version_and_keeps_the_status_of_a_status_subresource(
    api: Api,
) -> None:
    _, created = await api("POST", CONFIGMAPS, config_map(a="1", b="2"))
    replacement = {**created, "metadata": {**created["metadata"], "labels": {"a": "1"}}, "data": {"j": "w"}}
    status, replaced = await api("PUT", f"{CONFIGMAPS}/c", replacement)
    assert status == 200
    assert (replaced["metadata"]["labels"], replaced["data"]) == ({"a": "1"}, {"j": "w"})  # not merged: replaced
    status, stale = await api("PUT", f"{CONFIGMAPS}/c", replacement)  # the resourceVersion it read is gone
    assert (status, stale["reason"]) == (409, "Conflict")
    assert stale["message"] == (
        'Operation cannot be fulfilled on configmaps "c": the object has been modified; please apply your changes '
        "to the latest version and try again"
    )
    assert (await api("PUT", f"{CONFIGMAPS}/nope", config_map("nope")))[0] == 404

    _, sts = await api("POST", STATEFULSETS, stateful_set())
    await api("PATCH", f"{STATEFULSETS}/s/status", {"status": {"replicas": 1}}, MERGE)
    _, sts = await api("GET", f"{STATEFULSETS}/s")
    sts["spec"]["replicas"], sts["status"] = 3, {"replicas": 9}
    status, put = await api("PUT", f"{STATEFULSETS}/s", sts)
    assert (status, put["spec"]["replicas"], put["status"]) == (200, 3, {"replicas": 1})  # status: its own verb
    put["status"] = {"replicas": 2}
    status, put = await api("PUT", f"{STATEFULSETS}/s/status", put)
    assert (status, put["status"]) == (200, {"replicas": 2})

    _, dd = await api("POST", DEPLOYMENTS, deployment())
    del dd["metadata"]["resourceVersion"]
    status, refused = await api("PUT", f"{DEPLOYMENTS}/x", dd)
    assert (status, refused["reason"]) == (422, "Invalid")
    assert refused["message"] == (
        'DisaggregatedDeployment.kvbridge.io "x" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be '
        "specified for an update"
    )


async def test_a_strategic_merge_patch_merges_lists_by_key_and_a_custom_resource_refuses_it(api: Api) -> None:
    await api("POST", STATEFULSETS, stateful_set())
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "new"}]}}}}  # set image
    status, patched = await api("PATCH", f"{STATEFULSETS}/s", patch, STRATEGIC)
    assert status == 200
    engine, sidecar = patched["spec"]["template"]["spec"]["containers"]
    assert (engine["image"], engine["command"], engine["env"]) == ("new", ["serve"], [{"name": "X", "value": "1"}])
    assert sidecar == {"name": "sidecar", "image": "b"}  # merged by name: the other container is left alone
    env = {"containers": [{"name": "engine", "env": [{"name": "Y", "value": "2"}, {"name": "X", "$patch": "delete"}]}]}
    _, patched = await api("PATCH", f"{STATEFULSETS}/s", {"spec": {"template": {"spec": env}}}, STRATEGIC)
    assert patched["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "Y", "value": "2"}]
    gone = {"containers": [{"name": "sidecar", "$patch": "delete"}]}
    _, patched = await api("PATCH", f"{STATEFULSETS}/s", {"spec": {"template": {"spec": gone}}}, STRATEGIC)
    assert [c["name"] for c in patched["spec"]["template"]["spec"]["containers"]] == ["engine"]

    await api("POST", DEPLOYMENTS, deployment())
    status, refused = await api("PATCH", f"{DEPLOYMENTS}/x", {"metadata": {"labels": {"a": "b"}}}, STRATEGIC)
    assert (status, refused["reason"]) == (415, "UnsupportedMediaType")
    assert refused["message"] == (
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
    )
    assert (await api("PATCH", f"{DEPLOYMENTS}/x", {"metadata": {"labels": {"a": "b"}}}, "text/plain"))[0] == 415
    status, merged = await api("PATCH", f"{DEPLOYMENTS}/x", {"metadata": {"labels": {"a": "b"}}}, MERGE)
    assert (status, merged["metadata"]["labels"]) == (200, {"a": "b"})


def test_strategic_merge_directives() -> None:
    current = {"metadata": {"finalizers": ["a", "b"]}, "spec": {"x": 1, "y": 2, "z": {"k": 1}}}
    assert strategic_merge(current, {"metadata": {"finalizers": ["c", "a"]}})["metadata"]["finalizers"] == [
        "a",
        "b",
        "c",
    ]  # a merged list of values: added to
    assert strategic_merge(current, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}})["metadata"] == {
        "finalizers": ["b"]
    }
    assert strategic_merge(current, {"spec": {"$retainKeys": ["x", "w"], "w": 3}})["spec"] == {"x": 1, "w": 3}
    assert strategic_merge(current, {"spec": {"$patch": "replace", "q": 1}})["spec"] == {"q": 1}
    assert strategic_merge(current, {"spec": {"z": {"$patch": "delete"}}})["spec"] == {"x": 1, "y": 2}
    pod = {"spec": {"containers": [{"name": "a"}, {"name": "b"}]}}
    order = {"spec": {"$setElementOrder/containers": [{"name": "b"}, {"name": "a"}], "containers": [{"name": "a"}]}}
    assert strategic_merge(pod, order)["spec"]["containers"] == [{"name": "b"}, {"name": "a"}]
    ports = {"spec": {"ports": [{"port": 80, "name": "http"}]}}  # a Service's ports: merged by port
    merged = strategic_merge(ports, {"spec": {"ports": [{"port": 81, "name": "x"}]}})
    assert merged["spec"]["ports"] == [{"port": 80, "name": "http"}, {"port": 81, "name": "x"}]


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5))
_KEYS = st.sampled_from(["a", "b", "c", "spec", "data"])
_MAPS = st.recursive(_SCALARS, lambda inner: st.dictionaries(_KEYS, inner, max_size=4), max_leaves=12)


@given(st.dictionaries(_KEYS, _MAPS, max_size=4), st.dictionaries(_KEYS, _MAPS, max_size=4))
def test_without_lists_or_directives_a_strategic_merge_is_a_json_merge(current: Obj, patch: Obj) -> None:
    current = {k: v for k, v in current.items() if v is not None}
    assert strategic_merge(current, patch) == merge_patch(current, patch)


async def test_delete_honours_dry_run_and_preconditions(api: Api) -> None:
    _, created = await api("POST", CONFIGMAPS, config_map())
    assert (await api("DELETE", f"{CONFIGMAPS}/c", dryRun="All"))[0] == 200
    assert (await api("GET", f"{CONFIGMAPS}/c"))[0] == 200
    status, refused = await api("DELETE", f"{CONFIGMAPS}/c", {"preconditions": {"uid": "not-its-uid"}})
    assert (status, refused["reason"]) == (409, "Conflict")
    assert refused["message"] == (
        f'Operation cannot be fulfilled on configmaps "c": Precondition failed: UID in precondition: not-its-uid, '
        f"UID in object meta: {created['metadata']['uid']}"
    )
    stale = {"preconditions": {"resourceVersion": "1"}}
    assert (await api("DELETE", f"{CONFIGMAPS}/c", stale))[0] == 409
    assert (await api("DELETE", f"{CONFIGMAPS}/c", {"preconditions": {"uid": created["metadata"]["uid"]}}))[0] == 200
    assert (await api("GET", f"{CONFIGMAPS}/c"))[0] == 404


async def test_deletecollection_deletes_what_the_selector_matches(api: Api) -> None:
    for name, team in (("a", "x"), ("b", "x"), ("c", "y")):
        await api("POST", CONFIGMAPS, config_map(name, team=team))
    status, dry = await api("DELETE", CONFIGMAPS, labelSelector="team=x", dryRun="All")
    assert (status, [i["metadata"]["name"] for i in dry["items"]]) == (200, ["a", "b"])
    status, deleted = await api("DELETE", CONFIGMAPS, labelSelector="team=x")
    assert (status, deleted["kind"], [i["metadata"]["name"] for i in deleted["items"]]) == (
        200,
        "ConfigMapList",
        ["a", "b"],
    )
    _, left = await api("GET", CONFIGMAPS)
    assert [i["metadata"]["name"] for i in left["items"]] == ["c"]


async def test_deleting_an_owner_deletes_its_dependents_unless_they_are_orphaned(api: Api) -> None:
    """The garbage collector: ``kubectl delete dd`` takes the StatefulSets, and through them the pods (a pod with a
    finalizer, as the local kubelet's, gets its deletion timestamp and stays until it is released)."""
    _, owner = await api("POST", CONFIGMAPS, config_map("owner"))
    _, sts = await api("POST", STATEFULSETS, stateful_set(owner))
    held: Obj = {"name": "s-0", "finalizers": ["kvbridge.io/local-kubelet"]}
    held["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "s", "uid": sts["metadata"]["uid"]}
    ]
    await api("POST", PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": held, "spec": {"containers": []}})
    assert (await api("DELETE", f"{CONFIGMAPS}/owner"))[0] == 200
    assert (await api("GET", f"{STATEFULSETS}/s"))[0] == 404
    _, pod = await api("GET", f"{PODS}/s-0")
    assert pod["metadata"]["deletionTimestamp"]  # terminating: the kubelet ends it, then releases it
    await api("PATCH", f"{PODS}/s-0", {"metadata": {"finalizers": None}}, MERGE)
    assert (await api("GET", f"{PODS}/s-0"))[0] == 404

    _, owner = await api("POST", CONFIGMAPS, config_map("owner"))
    await api("POST", STATEFULSETS, stateful_set(owner))
    assert (await api("DELETE", f"{CONFIGMAPS}/owner", {"propagationPolicy": "Orphan"}))[0] == 200
    status, orphan = await api("GET", f"{STATEFULSETS}/s")
    assert (status, "ownerReferences" in orphan["metadata"]) == (200, False)
    status, refused = await api("DELETE", f"{STATEFULSETS}/s", {"propagationPolicy": "Sometimes"})
    assert (status, refused["reason"]) == (400, "BadRequest")
