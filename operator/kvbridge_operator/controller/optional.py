"""Pure: the optional children a spec asks for (``spec.router``'s, ``spec.inferencePool``'s, ``spec.placement.gang``'s
PodGroup), those it no longer asks for, and their status fields and events.

What to delete is known from the previous status, so a deployment that never had them costs no call. A cluster
without the InferencePool, HTTPRoute or PodGroup CRD (``missing``: the API answered 404 for the kind) gets a Warning,
not a failed reconcile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge_operator.api.names import router_name, router_peers_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import peer_key
from kvbridge_operator.children.objects.desired import optional_children
from kvbridge_operator.children.objects.router import router_url
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.actions import Event

#: kinds some clusters do not serve (their CRDs not installed)
OPTIONAL_KINDS = ("InferencePool", "HTTPRoute", "PodGroup")
#: the status fields these children fill
STATUS_FIELDS = ("router", "inferencePool", "placement")
ROUTER_KINDS = ("Deployment", "PodDisruptionBudget", "Service", "RoleBinding", "Role", "ServiceAccount")


@dataclass
class Optional:
    apply: list[Obj] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    status: Obj = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


def decide(
    dd: DisaggregatedDeployment, uid: str, config: OperatorConfig, previous: Obj, missing: frozenset[str]
) -> Optional:
    result = Optional(status=dict.fromkeys(STATUS_FIELDS))
    wanted = optional_children(dd, uid, config)
    result.apply = [child for child in wanted if child["kind"] not in missing]
    made = {child["kind"] for child in result.apply}
    lacking = [kind for kind in OPTIONAL_KINDS if kind in missing and any(c["kind"] == kind for c in wanted)]
    fields = result.status
    pool_before = previous.get("inferencePool") or {}
    group_before = previous.get("placement") or {}
    if "PodGroup" in lacking:
        lacking.remove("PodGroup")
        message = (
            "the API has no PodGroup resource (scheduling.x-k8s.io): install scheduler-plugins' "
            "coscheduling, or remove spec.placement.gang (pods wait for a scheduler that may not run)"
        )
        fields["placement"] = {"podGroup": "", "message": message}
        if group_before.get("message") != message:
            result.events.append(Event("Warning", "GangSchedulingUnavailable", message))
    elif "PodGroup" in made:
        fields["placement"] = {"podGroup": dd.metadata.name, "message": ""}
    elif group_before.get("podGroup"):
        result.delete.append(("PodGroup", str(group_before["podGroup"])))
    if lacking:
        message = (
            f"the API has no {' or '.join(lacking)} resource: install the Gateway API (Inference Extension) "
            "CRDs, or set spec.inferencePool.enabled: false"
        )
        fields["inferencePool"] = {"name": "", "httpRoute": "", "message": message}
        if pool_before.get("message") != message:
            result.events.append(Event("Warning", "ServingUnavailable", message))
    peers = router_peers_name(dd.metadata.name) if peer_key.peers(dd.spec) else ""
    if dd.spec.router.enabled:
        fields["router"] = {"url": router_url(dd), "peers": peers}
    elif previous.get("router"):
        result.delete += [(kind, router_name(dd.metadata.name)) for kind in ROUTER_KINDS]
        result.events.append(Event("Normal", "RouterRemoved", f"{router_name(dd.metadata.name)} deleted (spec.router)"))
    peers_before = str((previous.get("router") or {}).get("peers") or "")
    if peers_before and not peers:  # one replica, or no router: the replicas' Service goes (its Secret stays)
        result.delete.append(("Service", peers_before))
    if dd.spec.inference_pool.enabled and "InferencePool" in made:
        route = dd.metadata.name if "HTTPRoute" in made else ""
        note = fields["inferencePool"]["message"] if lacking else ""
        fields["inferencePool"] = {"name": dd.metadata.name, "httpRoute": route, "message": note}
    if pool_before.get("httpRoute") and not (fields["inferencePool"] or {}).get("httpRoute"):
        result.delete.append(("HTTPRoute", str(pool_before["httpRoute"])))
    if pool_before.get("name") and not fields["inferencePool"]:
        result.delete.append(("InferencePool", str(pool_before["name"])))
    return result
