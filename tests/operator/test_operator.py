"""The operator running in-process (Kopf) against the emulated API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.handlers import FINALIZER
from kvbridge_operator.kube import DEPLOYMENTS, PODS, USER_AGENT
from kvbridge_sim.cluster import Cluster, cluster

ROOT = Path(__file__).parents[2]
Obj = dict[str, Any]


def example(name: str) -> Obj:
    document: Obj = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    return document


CHILD_PLURALS = ("statefulsets", "services", "secrets", "networkpolicies")


def children(c: Cluster, name: str) -> dict[str, list[Obj]]:
    kinds: dict[str, list[Obj]] = {}
    for plural in CHILD_PLURALS:
        kinds[plural] = [
            o for o in c.api.objects_of(plural) if o["metadata"].get("labels", {}).get("kvbridge.io/deployment") == name
        ]
    return kinds


async def ready(c: Cluster, name: str) -> None:
    await c.run_pods(name, "prefill")
    await c.run_pods(name, "decode", ip_base="10.0.1.")
    await c.wait(lambda: c.condition(name, "Ready").get("status") == "True", what=f"{name} Ready")


async def test_create_makes_owned_children_status_and_events() -> None:
    async with cluster() as c:
        created = await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True", what="Compatible")
        kids = children(c, "llama3-8b")
        assert sorted(o["metadata"]["name"] for o in kids["statefulsets"]) == ["llama3-8b-decode", "llama3-8b-prefill"]
        assert sorted(o["metadata"]["name"] for o in kids["services"]) == ["llama3-8b-decode", "llama3-8b-prefill"]
        assert [o["metadata"]["name"] for o in kids["secrets"]] == ["llama3-8b-side-channel"]
        assert [o["metadata"]["name"] for o in kids["networkpolicies"]] == ["llama3-8b-pods"]
        for obj in (o for objs in kids.values() for o in objs):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        prefill = next(o for o in kids["statefulsets"] if o["metadata"]["name"].endswith("prefill"))
        container = prefill["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        assert {e["name"] for e in container["env"]} >= {"KVBRIDGE_ROLE", "KVBRIDGE_FINGERPRINT", "KVBRIDGE_KEYS_DIR"}
        status = c.deployment("llama3-8b")["status"]
        assert status["plan"]["tpRatio"] == -2
        assert status["plan"]["readsPerDecodeRank"] == 2
        assert status["plan"]["descriptorsPerBlock"] == 128
        assert status["observedGeneration"] == 1
        assert status["tp"] == "2→1"
        assert prefill["spec"]["template"]["metadata"]["labels"]["kvbridge.io/fingerprint"] == status["fingerprint"]
        assert len(status["pairing"]) == 10
        for sts in kids["statefulsets"]:
            assert sts["spec"]["template"]["metadata"]["labels"]["kvbridge.io/pairing"] == status["pairing"]

        await ready(c, "llama3-8b")
        status = c.deployment("llama3-8b")["status"]
        assert status["prefill"]["ready"] == "2/2"
        assert status["decode"]["ready"] == "1/1"
        revision = next(
            s["spec"]["template"]["metadata"]["labels"]["kvbridge.io/revision"]
            for s in kids["statefulsets"]
            if s["metadata"]["name"].endswith("prefill")
        )
        pods = {o["metadata"]["name"]: o for o in c.api.objects_of("pods")}
        for found in status["prefill"]["endpoints"]:  # uid:restarts, so that routers forget a restarted pod
            assert found.pop("incarnation") == f"{pods[found['pod']]['metadata']['uid']}:0"
        assert status["prefill"]["endpoints"] == [
            {
                "pod": "llama3-8b-prefill-0",
                "ip": "10.0.0.1",
                "port": 5600,
                "ranks": 2,
                "revision": revision,
                "fingerprint": status["fingerprint"],
                "pairing": status["pairing"],
                "httpPort": 8000,
            },
            {
                "pod": "llama3-8b-prefill-1",
                "ip": "10.0.0.2",
                "port": 5600,
                "ranks": 2,
                "revision": revision,
                "fingerprint": status["fingerprint"],
                "pairing": status["pairing"],
                "httpPort": 8000,
            },
        ]
        await c.wait(lambda: "EndpointsChanged" in c.reasons("llama3-8b"), what="EndpointsChanged event")
        assert "Reconciled" in c.reasons("llama3-8b")
        assert not any(e["type"] == "Warning" for e in c.events("llama3-8b"))


async def test_the_finalizer_is_set_and_released_on_delete() -> None:
    """Kopf sets the operator's finalizer (its 60 s resync timer needs one) and removes it once the timer stopped:
    the delete completes without the operator doing anything else (docs/operator.md, "Deleting a deployment")."""
    assert FINALIZER == "kvbridge.io/finalizer"
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))

        def finalized() -> bool:
            return FINALIZER in c.deployment("llama3-8b")["metadata"].get("finalizers", [])

        def gone() -> bool:
            return c.api.find("disaggregateddeployments", "default", "llama3-8b") is None

        await c.wait(finalized, what="finalizer set")
        await c.client.delete(DEPLOYMENTS, "default", "llama3-8b")
        await c.wait(gone, what="deployment gone")


async def test_incompatible_create_schedules_nothing_and_says_why() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/incompatible-replicated-heads"))
        await c.wait(lambda: c.condition("replicated-heads", "Compatible").get("status") == "False")
        condition = c.condition("replicated-heads", "Compatible")
        assert condition["reason"] == "Incompatible"
        assert "PREFILL_HEADS_REPLICATED at spec.prefill.tensorParallelSize" in condition["message"]
        assert c.condition("replicated-heads", "Ready")["status"] == "False"
        assert children(c, "replicated-heads") == {
            "statefulsets": [],
            "services": [],
            "secrets": [],
            "networkpolicies": [],
        }
        await c.wait(lambda: "Incompatible" in c.reasons("replicated-heads"), what="Incompatible event")
        [warning] = [e for e in c.events("replicated-heads") if e["reason"] == "Incompatible"]
        assert warning["type"] == "Warning"
        assert "set spec.prefill.tensorParallelSize: 2" in warning["message"]
        assert warning["message"].endswith("A fix that passes every check: spec.prefill.tensorParallelSize: 2")


async def test_incompatible_update_keeps_the_running_revision() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")
        before = {o["metadata"]["name"]: o for o in children(c, "llama3-8b")["statefulsets"]}
        await c.patch_spec("llama3-8b", {"decode": {"tensorParallelSize": 3}})
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "False", what="refused")
        condition = c.condition("llama3-8b", "Compatible")
        assert "TP_NOT_DIVISIBLE at spec.decode.tensorParallelSize" in condition["message"]
        assert condition["observedGeneration"] == 2
        after = {o["metadata"]["name"]: o for o in children(c, "llama3-8b")["statefulsets"]}
        assert {k: v["spec"] for k, v in after.items()} == {k: v["spec"] for k, v in before.items()}
        status = c.deployment("llama3-8b")["status"]
        assert status["plan"]["tpRatio"] == -2  # the plan of what runs
        assert status["prefill"]["readyReplicas"] == 2  # still serving
        assert c.condition("llama3-8b", "PrefillReady")["status"] == "True"
        await c.wait(lambda: "Incompatible" in c.reasons("llama3-8b"))
        # fixing the spec resumes reconciling
        await c.patch_spec("llama3-8b", {"decode": {"tensorParallelSize": 2}})
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True", what="fixed")
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["plan"]["tpRatio"] == 1)


async def test_pod_readiness_ip_change_restart_and_deletion_move_endpoints() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")

        def ips() -> list[str]:
            return [e["ip"] for e in c.deployment("llama3-8b")["status"]["prefill"]["endpoints"]]

        await c.set_pod("llama3-8b-prefill-1", ready=False, ip="10.0.0.2")
        await c.wait(lambda: ips() == ["10.0.0.1"], what="not-ready pod leaves the endpoints")
        assert c.condition("llama3-8b", "PrefillReady")["status"] == "False"
        assert c.condition("llama3-8b", "Ready")["status"] == "False"

        await c.set_pod("llama3-8b-prefill-1", ready=True, ip="10.0.0.99")
        await c.wait(lambda: ips() == ["10.0.0.1", "10.0.0.99"], what="new IP published")
        await c.wait(lambda: c.condition("llama3-8b", "Ready").get("status") == "True")

        await c.set_pod("llama3-8b-prefill-0", ready=True, ip="10.0.0.1", restarts=1)
        await c.wait(lambda: "PrefillRestarted" in c.reasons("llama3-8b"), what="PrefillRestarted")
        [restart] = [e for e in c.events("llama3-8b") if e["reason"] == "PrefillRestarted"]
        assert "llama3-8b-prefill-0" in restart["message"]

        await c.client.delete(PODS, "default", "llama3-8b-prefill-0")
        await c.wait(lambda: ips() == ["10.0.0.99"], what="deleted pod leaves the endpoints")
        assert c.deployment("llama3-8b")["status"]["prefill"]["ready"] == "1/2"
        ready_condition = c.condition("llama3-8b", "Ready")
        assert ready_condition["reason"] == "ReplicasNotReady"


async def test_a_pod_event_writes_the_status_and_nothing_else() -> None:
    """A pod changes no spec: the operator observes and patches the status, and leaves the children (and the
    fields an autoscaler or a user set on them) alone; the periodic resync re-applies them."""
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")

        def child_writes() -> int:
            return sum(
                n
                for (agent, verb, plural), n in c.api.calls.items()
                if agent == USER_AGENT
                and plural in CHILD_PLURALS
                and "fetch" not in verb.lower()
                and "list" not in verb.lower()
                and "watch" not in verb.lower()
            )

        before = child_writes()
        await c.set_pod("llama3-8b-prefill-1", ready=True, ip="10.0.0.77")

        def ips() -> list[str]:
            return [e["ip"] for e in c.deployment("llama3-8b")["status"]["prefill"]["endpoints"]]

        await c.wait(lambda: "10.0.0.77" in ips(), what="the new IP published")
        assert child_writes() == before


async def test_conditions_keep_their_transition_time_unless_they_flip() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        first = c.condition("llama3-8b", "Compatible")["lastTransitionTime"]
        await ready(c, "llama3-8b")
        assert c.condition("llama3-8b", "Compatible")["lastTransitionTime"] == first


async def test_spec_change_rolls_out_with_fingerprints() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")
        old = c.deployment("llama3-8b")["status"]["fingerprint"]
        await c.patch_spec("llama3-8b", {"model": {"kvCacheDtype": "fp8_e4m3"}})
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["fingerprint"] != old, what="new fingerprint")
        new = c.deployment("llama3-8b")["status"]["fingerprint"]
        prefill = c.api.find("statefulsets", "default", "llama3-8b-prefill")
        assert prefill is not None
        assert prefill["spec"]["template"]["metadata"]["labels"]["kvbridge.io/fingerprint"] == new
        # the StatefulSet controller replaces one pod; old and new coexist
        await c.replace_pod("llama3-8b", "prefill", 1, ip="10.0.0.12")

        def fingerprints() -> dict[str, str]:
            endpoints = c.deployment("llama3-8b")["status"]["prefill"]["endpoints"]
            return {e["pod"]: e["fingerprint"] for e in endpoints}

        await c.wait(
            lambda: fingerprints() == {"llama3-8b-prefill-0": old, "llama3-8b-prefill-1": new},
            what="old and new endpoints side by side",
        )
        status = c.deployment("llama3-8b")["status"]
        assert (status["prefill"]["updatedReplicas"], status["prefill"]["readyReplicas"]) == (1, 2)
        assert status["observedGeneration"] == 2
        await c.wait(
            lambda: any(
                "1/2 pods on the current revision" in e["message"]
                for e in c.events("llama3-8b")
                if e["reason"] == "RolloutProgress"
            ),
            what="RolloutProgress 1/2",
        )


async def test_tp_change_keeps_the_fingerprint_but_not_the_pairing_key_of_the_endpoints() -> None:
    """A router tells old and new pods apart during a TP change: same model, so same fingerprint, but another
    pairing key on the new pods and their endpoints (the fingerprint alone cannot tell them apart)."""
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")
        before = c.deployment("llama3-8b")["status"]
        await c.patch_spec("llama3-8b", {"prefill": {"tensorParallelSize": 4}})
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["pairing"] != before["pairing"], what="new pairing")
        after = c.deployment("llama3-8b")["status"]
        assert after["fingerprint"] == before["fingerprint"]
        sts = {role: c.api.find("statefulsets", "default", f"llama3-8b-{role}") for role in ("prefill", "decode")}
        for obj in sts.values():
            assert obj is not None
            assert obj["spec"]["template"]["metadata"]["labels"]["kvbridge.io/pairing"] == after["pairing"]
        await c.replace_pod("llama3-8b", "prefill", 1, ip="10.0.0.12")

        def keys() -> dict[str, tuple[str, str, int]]:
            endpoints = c.deployment("llama3-8b")["status"]["prefill"]["endpoints"]
            return {e["pod"]: (e["fingerprint"], e["pairing"], e["ranks"]) for e in endpoints}

        await c.wait(
            lambda: (
                keys()
                == {
                    "llama3-8b-prefill-0": (before["fingerprint"], before["pairing"], 2),
                    "llama3-8b-prefill-1": (before["fingerprint"], after["pairing"], 4),
                }
            ),
            what="old and new endpoints with their own pairing keys",
        )


async def test_secret_is_created_once_and_kept_across_updates() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        first = c.api.find("secrets", "default", "llama3-8b-side-channel")
        await c.patch_spec("llama3-8b", {"prefill": {"replicas": 3}})
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["prefill"]["replicas"] == 3)
        second = c.api.find("secrets", "default", "llama3-8b-side-channel")
        assert first is not None
        assert second is not None
        assert second["data"] == first["data"]
        assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


async def test_operator_restart_converges_without_duplicates() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.apply(example("synthetic/deepseek-mla"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await c.stop_operator()  # possibly in the middle of reconciling deepseek-mla
        await c.patch_spec("llama3-8b", {"decode": {"replicas": 2}})  # changed while no operator runs
        await c.start_operator()
        await c.wait(lambda: c.condition("deepseek-mla", "Compatible").get("status") == "True")
        await c.wait(lambda: c.deployment("llama3-8b")["status"]["decode"]["replicas"] == 2, what="resumed")
        names = [o["metadata"]["name"] for o in c.api.objects_of("statefulsets")]
        assert sorted(names) == sorted(set(names))
        assert len(names) == 4
        assert len(c.api.objects_of("secrets")) == 2


async def test_bad_resource_is_reported_not_crash_looped() -> None:
    async with cluster() as c:
        bad = example("synthetic/llama3-8b-hetero-tp")
        bad["metadata"]["name"] = "bad"
        bad["spec"]["decode"]["tensorParallelSize"] = "two"  # the emulator does no schema validation
        await c.apply(bad)
        await c.apply(example("synthetic/deepseek-mla"))
        await c.wait(lambda: c.condition("bad", "Compatible").get("reason") == "InvalidSpec", what="InvalidSpec")
        assert "spec.decode.tensorParallelSize" in c.condition("bad", "Compatible")["message"]
        await c.wait(lambda: "InvalidSpec" in c.reasons("bad"))
        await c.wait(lambda: c.condition("deepseek-mla", "Compatible").get("status") == "True", what="others go on")
        assert children(c, "bad")["statefulsets"] == []


async def test_cpu_mode_requests_no_gpus_and_vllm_settings_it_cannot_honour_are_refused() -> None:
    async with cluster(OperatorConfig(cpu_mode=True, liveness_port=0)) as c:
        await c.apply(example("synthetic/deepseek-mla"))
        vllm = example("synthetic/hetero-block-size")  # needs a prefill-side block split: the kvbridge agent only
        vllm["spec"]["engine"] = {"kind": "VLLM"}
        await c.apply(vllm)
        await c.wait(lambda: c.condition("deepseek-mla", "Compatible").get("status") == "True")
        sts = c.api.find("statefulsets", "default", "deepseek-mla-prefill")
        assert sts is not None
        resources = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert "limits" not in resources
        env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["KVBRIDGE_DEVICE"] == "cpu"
        name = vllm["metadata"]["name"]
        await c.wait(lambda: c.condition(name, "Compatible").get("status") == "False")
        assert "VLLM_PREFILL_CONVERSION at spec.prefill.blockSize" in c.condition(name, "Compatible")["message"]
        assert children(c, name)["statefulsets"] == []


async def test_unverified_transfers_are_said_in_the_status_and_one_warning_event() -> None:
    """vLLM's NixlConnector with the default verification (Sampled) runs without a transfer digest: the deployment
    is applied (refusing it would refuse the defaults), and status.advisories and a Warning event (Advisory) name
    the code, the field and the fix, once per generation; verification Off says what runs and clears them."""
    async with cluster() as c:
        document = yaml.safe_load((ROOT / "examples" / "vllm" / "tiny-cpu.yaml").read_text())
        name = document["metadata"]["name"]
        await c.apply(document)
        await c.wait(lambda: c.condition(name, "Compatible").get("status") == "True", what="Compatible")
        await c.wait(lambda: bool(c.deployment(name)["status"].get("advisories")), what="status.advisories")
        [advisory] = c.deployment(name)["status"]["advisories"]
        assert (advisory["code"], advisory["field"]) == ("VLLM_NIXL_UNVERIFIED_SAMPLED", "spec.transfer.verification")
        assert "spec.engine.connector: KVBridge" in advisory["message"]
        await c.wait(lambda: "Advisory" in c.reasons(name), what="Advisory event")
        await ready(c, name)  # pod events reconcile again: the same generation is not announced twice
        [event] = [e for e in c.events(name) if e["reason"] == "Advisory"]
        assert event["type"] == "Warning"
        assert event["message"].startswith("VLLM_NIXL_UNVERIFIED_SAMPLED at spec.transfer.verification: ")
        assert children(c, name)["statefulsets"]  # applied: an advisory refuses nothing
        await c.patch_spec(name, {"transfer": {"verification": "Off"}})
        await c.wait(lambda: c.deployment(name)["status"].get("observedGeneration") == 2, what="generation 2")
        assert c.deployment(name)["status"]["advisories"] == []
        assert len([e for e in c.events(name) if e["reason"] == "Advisory"]) == 1


def printer_columns(obj: Obj) -> list[str]:
    """What `kubectl get dd` prints for an object, from the CRD's printer-column JSONPaths."""
    from kvbridge_operator.api.crd import crd

    row = []
    for column in crd()["spec"]["versions"][0]["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status.conditions[?(@.type=="):
            wanted = path.split('"')[1]
            conditions = (obj.get("status") or {}).get("conditions") or []
            row.append(next((c["status"] for c in conditions if c["type"] == wanted), ""))
        else:
            value: Any = obj
            for part in path.strip(".").split("."):
                value = value.get(part, "") if isinstance(value, dict) else ""
            row.append(str(value))
    return row


async def test_the_operators_gpus_per_node_refuses_an_engine_no_node_can_hold() -> None:
    """The chart's gpu.perNode (KVBRIDGE_OPERATOR_GPUS_PER_NODE) checks deployments that state no gpusPerNode."""
    async with cluster(OperatorConfig(gpus_per_node=8, liveness_port=0)) as c:
        big = example("synthetic/deepseek-mla")
        big["spec"]["prefill"]["tensorParallelSize"] = 16
        await c.apply(big)
        await c.wait(lambda: c.condition("deepseek-mla", "Compatible").get("status") == "False")
        assert (
            "ROLE_DOES_NOT_FIT at spec.prefill.tensorParallelSize"
            in c.condition("deepseek-mla", "Compatible")["message"]
        )
        assert children(c, "deepseek-mla")["statefulsets"] == []


async def test_kubectl_get_columns_show_ready_replicas_and_tp() -> None:
    async with cluster() as c:
        await c.apply(example("synthetic/llama3-8b-hetero-tp"))
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")
        columns = printer_columns(c.deployment("llama3-8b"))
        ready_col, available, prefill, decode, tp, router, planner, planned, age = columns
        assert (ready_col, available, prefill, decode, tp) == ("True", "True", "2/2", "1/1", "2→1")
        assert (router, planner, planned) == ("", "", "")
        assert age.endswith("Z")


async def test_spec_router_runs_a_router_with_read_only_rbac_and_shows_its_url() -> None:
    """spec.router.enabled: a Deployment, PodDisruptionBudget, Service, ServiceAccount, Role and RoleBinding,
    status.router.url (a printer column), and decode endpoints in the status for it; disabling it deletes them."""
    names = ("deployments", "poddisruptionbudgets", "services", "serviceaccounts", "roles", "rolebindings")
    async with cluster() as c:
        document = example("synthetic/llama3-8b-hetero-tp")
        document["spec"]["router"] = {"enabled": True, "replicas": 2, "prefillTimeoutSeconds": 30}
        await c.apply(document)
        await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True")
        await ready(c, "llama3-8b")
        await c.wait(lambda: (c.deployment("llama3-8b")["status"].get("router") or {}).get("url"), what="router url")
        assert printer_columns(c.deployment("llama3-8b"))[5] == "http://llama3-8b-router.default.svc:8000"
        for plural in names:
            assert c.api.find(plural, "default", "llama3-8b-router") is not None, plural
        deployment = c.api.find("deployments", "default", "llama3-8b-router")
        assert deployment is not None
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["kvbridge-router"]
        assert container["args"][:2] == ["--deployment=llama3-8b", "--namespace=default"]
        assert "--prefill-timeout=30" in container["args"]
        assert deployment["spec"]["replicas"] == 2
        assert "--replicas=2" in container["args"]  # each replica scales its own counts of requests in flight
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert [(s["topologyKey"], s["whenUnsatisfiable"]) for s in spread] == [
            ("kubernetes.io/hostname", "ScheduleAnyway")
        ]
        role = c.api.find("roles", "default", "llama3-8b-router")
        assert role is not None
        assert role["rules"] == [
            {
                "apiGroups": ["kvbridge.io"],
                "resources": ["disaggregateddeployments"],
                "resourceNames": ["llama3-8b"],
                "verbs": ["get", "list", "watch"],
            }
        ]
        decode = c.deployment("llama3-8b")["status"]["decode"]["endpoints"]
        assert [(e["pod"], e["httpPort"]) for e in decode] == [("llama3-8b-decode-0", 8000)]
        # two replicas report to each other: a headless Service of them all, a key of their own
        peers = c.api.find("services", "default", "llama3-8b-router-peers")
        assert peers is not None
        assert peers["spec"]["clusterIP"] == "None"
        assert c.api.find("secrets", "default", "llama3-8b-router-peers") is not None
        assert c.deployment("llama3-8b")["status"]["router"]["peers"] == "llama3-8b-router-peers"
        await c.patch_spec("llama3-8b", {"router": {"replicas": 1}})
        await c.wait(
            lambda: c.api.find("services", "default", "llama3-8b-router-peers") is None, what="peers Service deleted"
        )
        await c.wait(lambda: not c.deployment("llama3-8b")["status"]["router"].get("peers"), what="status.router.peers")
        await c.patch_spec("llama3-8b", {"router": {"enabled": False}})
        await c.wait(
            lambda: all(c.api.find(p, "default", "llama3-8b-router") is None for p in names),
            what="router children deleted",
        )
        await c.wait(lambda: "router" not in c.deployment("llama3-8b")["status"], what="status.router removed")
        await c.wait(lambda: "RouterRemoved" in c.reasons("llama3-8b"), what="the event")  # posted after the status


def _crd_of(group: str, kind: str, plural: str, version: str = "v1") -> Obj:
    """A minimal CustomResourceDefinition, as the Gateway API (Inference Extension) installs it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }


async def test_an_inference_pool_without_its_crd_is_a_warning_and_with_it_is_made() -> None:
    from kvbridge_operator.kube import Resource

    crds = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
    async with cluster() as c:
        document = example("synthetic/llama3-8b-hetero-tp")
        document["spec"]["inferencePool"] = {"enabled": True, "endpointPicker": "llm-d-epp", "gateway": "gw"}
        await c.apply(document)
        await c.wait(lambda: "ServingUnavailable" in c.reasons("llama3-8b"), what="the warning")
        status = c.deployment("llama3-8b")["status"]
        assert "InferencePool" in status["inferencePool"]["message"]
        assert c.condition("llama3-8b", "Compatible")["status"] == "True"  # the rest was applied
        for group, kind, plural in (
            ("inference.networking.k8s.io", "InferencePool", "inferencepools"),
            ("gateway.networking.k8s.io", "HTTPRoute", "httproutes"),
        ):
            await c.client.create(crds, "", _crd_of(group, kind, plural))
        await c.patch_spec("llama3-8b", {"inferencePool": {"endpointPickerPort": 9003}})
        await c.wait(
            lambda: c.deployment("llama3-8b")["status"]["inferencePool"]["httpRoute"] == "llama3-8b",
            what="pool and route made",
        )
        pool = c.api.find("inferencepools", "default", "llama3-8b")
        assert pool is not None
        assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9003}
        await c.patch_spec("llama3-8b", {"inferencePool": {"gateway": ""}})
        await c.wait(lambda: c.api.find("httproutes", "default", "llama3-8b") is None, what="route deleted")
        assert c.api.find("inferencepools", "default", "llama3-8b") is not None


async def test_gang_scheduling_makes_a_pod_group_where_its_crd_exists() -> None:
    from kvbridge_operator.kube import Resource

    crds = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
    async with cluster() as c:
        document = example("synthetic/llama3-8b-hetero-tp")
        document["spec"]["placement"] = {"gang": {}}
        await c.apply(document)
        await c.wait(lambda: "GangSchedulingUnavailable" in c.reasons("llama3-8b"), what="the warning")
        assert "PodGroup" in c.deployment("llama3-8b")["status"]["placement"]["message"]
        await c.client.create(crds, "", _crd_of("scheduling.x-k8s.io", "PodGroup", "podgroups", "v1alpha1"))
        await c.patch_spec("llama3-8b", {"placement": {"gang": {"minMember": 2}}})
        await c.wait(
            lambda: c.deployment("llama3-8b")["status"]["placement"]["podGroup"] == "llama3-8b", what="pod group made"
        )
        group = c.api.find("podgroups", "default", "llama3-8b")
        assert group is not None
        assert group["spec"]["minMember"] == 2
        await c.patch_spec("llama3-8b", {"placement": {"gang": None}})
        await c.wait(lambda: c.api.find("podgroups", "default", "llama3-8b") is None, what="pod group deleted")


async def test_a_prefill_spanning_two_nodes_runs_as_leader_worker_groups_with_one_endpoint_per_engine() -> None:
    """DeepSeek-V3 with prefill TP 16 over two 8-GPU nodes: a LeaderWorkerSet of groups of 2 pods (decode stays a
    StatefulSet); each group's leader is the engine's endpoint with all 16 ranks, its worker is not an engine."""
    from kvbridge_operator.kube import Resource

    crds = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
    async with cluster() as c:
        await c.client.create(crds, "", _crd_of("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets"))
        document = yaml.safe_load((ROOT / "examples" / "vllm" / "deepseek-v3-h200.yaml").read_text())
        document["spec"]["prefill"].update(tensorParallelSize=16, nodes=2)
        await c.apply(document)
        await c.wait(
            lambda: (
                c.api.find("leaderworkersets", "default", "deepseek-v3-prefill") is not None
                and c.api.find("statefulsets", "default", "deepseek-v3-decode") is not None
            ),
            what="the prefill LeaderWorkerSet and the decode StatefulSet",
        )
        assert c.api.find("statefulsets", "default", "deepseek-v3-prefill") is None
        lws = c.api.find("leaderworkersets", "default", "deepseek-v3-prefill")
        assert lws is not None
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        made = await c.run_groups("deepseek-v3", "prefill")
        names = [p["metadata"]["name"] for p in made]
        assert names == [f"deepseek-v3-prefill-{g}{w}" for g in (0, 1) for w in ("", "-1")]  # leader, then worker
        await c.run_pods("deepseek-v3", "decode", ip_base="10.0.1.")
        await c.wait(lambda: c.condition("deepseek-v3", "Ready").get("status") == "True", what="Ready")
        status = c.deployment("deepseek-v3")["status"]
        endpoints = status["prefill"]["endpoints"]
        assert [(e["pod"], e["ranks"]) for e in endpoints] == [
            ("deepseek-v3-prefill-0", 16),
            ("deepseek-v3-prefill-1", 16),
        ]
        assert status["prefill"]["ready"] == "2/2"  # engines, not pods


async def test_a_multi_node_role_without_the_leader_worker_set_crd_is_a_warning() -> None:
    """Without LWS installed a multi-node role is a Warning, and the StatefulSet it would replace stays."""
    async with cluster() as c:
        document = yaml.safe_load((ROOT / "examples" / "vllm" / "deepseek-v3-h200.yaml").read_text())
        await c.apply(document)
        await c.wait(lambda: c.api.find("statefulsets", "default", "deepseek-v3-prefill") is not None, what="sts")
        await c.patch_spec("deepseek-v3", {"prefill": {"tensorParallelSize": 16, "nodes": 2}})
        await c.wait(lambda: "LeaderWorkerSetUnavailable" in c.reasons("deepseek-v3"), what="the warning")
        assert c.api.find("statefulsets", "default", "deepseek-v3-prefill") is not None  # not retired for nothing
        assert "WorkloadReplaced" not in c.reasons("deepseek-v3")
        # once per reconcile that finds LWS missing: under load a second reconcile may post it again (a real
        # cluster's event recorder would count the repeat), always the same words
        warnings = [e for e in c.events("deepseek-v3") if e["reason"] == "LeaderWorkerSetUnavailable"]
        assert len({(e["type"], e["message"]) for e in warnings}) == 1
        warning = warnings[0]
        assert warning["type"] == "Warning"
        assert "set spec.prefill.nodes to 1" in warning["message"]
        assert c.api.find("statefulsets", "default", "deepseek-v3-decode") is not None  # the rest is applied


async def test_nodes_crossing_one_replaces_the_roles_workload_and_says_so() -> None:
    from kvbridge_operator.kube import Resource

    crds = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
    async with cluster() as c:
        await c.client.create(crds, "", _crd_of("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets"))
        document = yaml.safe_load((ROOT / "examples" / "vllm" / "deepseek-v3-h200.yaml").read_text())
        await c.apply(document)
        await c.wait(lambda: c.api.find("statefulsets", "default", "deepseek-v3-prefill") is not None, what="sts")
        await c.patch_spec("deepseek-v3", {"prefill": {"tensorParallelSize": 16, "nodes": 2}})
        await c.wait(
            lambda: (
                c.api.find("leaderworkersets", "default", "deepseek-v3-prefill") is not None
                and c.api.find("statefulsets", "default", "deepseek-v3-prefill") is None
            ),
            what="the StatefulSet replaced by a LeaderWorkerSet",
        )
        await c.wait(lambda: "WorkloadReplaced" in c.reasons("deepseek-v3"), what="the event")
        [event] = [e for e in c.events("deepseek-v3") if e["reason"] == "WorkloadReplaced"][:1]
        assert "StatefulSet deepseek-v3-prefill" in event["message"]
        await c.patch_spec("deepseek-v3", {"prefill": {"tensorParallelSize": 8, "nodes": 1}})
        await c.wait(
            lambda: (
                c.api.find("statefulsets", "default", "deepseek-v3-prefill") is not None
                and c.api.find("leaderworkersets", "default", "deepseek-v3-prefill") is None
            ),
            what="and back",
        )


async def test_an_in_place_change_of_a_multi_node_role_steps_its_leader_worker_set() -> None:
    """A change that keeps old and new pods compatible (an image) rolls the multi-node prefill in place: the
    rollout's step is written to the LeaderWorkerSet (a surge group, then the partition), as for a StatefulSet."""
    from kvbridge_operator.kube import Resource

    crds = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
    async with cluster() as c:
        await c.client.create(crds, "", _crd_of("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "leaderworkersets"))
        await c.apply(
            yaml.safe_load((ROOT / "examples" / "vllm" / "deepseek-v3-h200-two-node-prefill.yaml").read_text())
        )
        name = "deepseek-v3-2n"
        await c.wait(lambda: c.api.find("statefulsets", "default", f"{name}-decode") is not None, what="applied")
        await c.run_groups(name, "prefill")
        await c.run_pods(name, "decode", ip_base="10.0.1.")
        await c.wait(lambda: c.condition(name, "Ready").get("status") == "True", what="Ready")

        def rolling() -> tuple[int, int]:
            lws = c.api.find("leaderworkersets", "default", f"{name}-prefill") or {}
            spec = lws.get("spec") or {}
            partition = spec["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"]
            return int(spec["replicas"]), int(partition)

        assert rolling() == (1, 0)
        await c.patch_spec(
            name,
            {
                "prefill": {
                    "template": {"spec": {"containers": [{"name": "engine", "image": "registry.example/vllm:patched"}]}}
                }
            },
        )
        await c.wait(
            lambda: (c.deployment(name)["status"].get("rollout") or {}).get("phase") == "RollingPrefill",
            what="the prefill rolls",
        )
        assert c.deployment(name)["status"]["rollout"]["strategy"] == "InPlace"
        assert rolling() == (2, 1)  # one surge group on the new template; group 0 keeps the old until it is ready
