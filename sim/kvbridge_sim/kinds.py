"""The kinds the emulated API serves before any CRD is installed (their subresources and short names, as
Kubernetes lists them), and the ``autoscaling/v1`` Scale of a kind that has one."""

from __future__ import annotations

from typing import Any

import kmock

from kvbridge_operator.api.objects import Obj, with_fields
from kvbridge_sim import field_managers

_SCALE = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
BUILTIN: dict[tuple[str, str, str], dict[str, Any]] = {
    ("", "v1", "pods"): {"kind": "Pod", "namespaced": True, "subresources": {"status", "log"}, "shortnames": {"po"}},
    ("", "v1", "services"): {"kind": "Service", "namespaced": True, "subresources": {"status"}, "shortnames": {"svc"}},
    ("", "v1", "secrets"): {"kind": "Secret", "namespaced": True},
    ("", "v1", "configmaps"): {"kind": "ConfigMap", "namespaced": True, "shortnames": {"cm"}},
    ("", "v1", "events"): {"kind": "Event", "namespaced": True, "shortnames": {"ev"}},
    ("", "v1", "namespaces"): {
        "kind": "Namespace",
        "namespaced": False,
        "subresources": {"status"},
        "shortnames": {"ns"},
    },
    ("apps", "v1", "statefulsets"): {
        "kind": "StatefulSet",
        "namespaced": True,
        "subresources": {"status", "scale"},
        "scale": _SCALE,
        "shortnames": {"sts"},
    },
    ("networking.k8s.io", "v1", "networkpolicies"): {
        "kind": "NetworkPolicy",
        "namespaced": True,
        "shortnames": {"netpol"},
    },
    ("apps", "v1", "deployments"): {
        "kind": "Deployment",
        "namespaced": True,
        "subresources": {"status", "scale"},
        "scale": _SCALE,
        "shortnames": {"deploy"},
    },
    ("", "v1", "serviceaccounts"): {"kind": "ServiceAccount", "namespaced": True, "shortnames": {"sa"}},
    ("rbac.authorization.k8s.io", "v1", "roles"): {"kind": "Role", "namespaced": True},
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): {"kind": "RoleBinding", "namespaced": True},
    ("policy", "v1", "poddisruptionbudgets"): {
        "kind": "PodDisruptionBudget",
        "namespaced": True,
        "subresources": {"status"},
        "shortnames": {"pdb"},
    },
    ("events.k8s.io", "v1", "events"): {"kind": "Event", "namespaced": True, "shortnames": {"ev"}},
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions"): {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
        "subresources": {"status"},
        "shortnames": {"crd", "crds"},
    },
}


def scale_of(obj: Obj, paths: dict[str, str]) -> Obj:
    """The ``autoscaling/v1`` Scale of an object (what HPA, KEDA and ``kubectl scale`` read and write)."""

    def at(path: str | None) -> Any:
        return field_managers.lookup(obj, tuple(path.strip(".").split("."))) if path else None

    selector = at(paths.get("labelSelectorPath"))
    if selector is None and "matchLabels" in (obj.get("spec", {}).get("selector") or {}):
        selector = ",".join(f"{k}={v}" for k, v in obj["spec"]["selector"]["matchLabels"].items())
    meta = obj["metadata"]
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta},
        "spec": {"replicas": at(paths["specReplicasPath"]) or 0},
        "status": {
            "replicas": at(paths.get("statusReplicasPath")) or 0,
            **({"selector": selector} if selector else {}),
        },
    }


def scaled(current: Obj, data: Any, paths: dict[str, str]) -> Obj:
    replicas = (data or {}).get("spec", {}).get("replicas") if isinstance(data, dict) else None
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise kmock.KubernetesError(status=422, reason="Invalid", message="spec.replicas: must be >= 0")
    return with_fields(current, {paths["specReplicasPath"].strip("."): replicas})


def api_resource_list(
    kinds: dict[tuple[str, str, str], dict[str, Any]], group: str, version: str, verbs: set[str]
) -> Obj | None:
    """``/api/v1``, ``/apis/GROUP/VERSION``: the APIResourceList, subresources as Kubernetes lists them (no short
    names, ``scale`` of kind ``autoscaling/v1`` Scale), so ``kubectl`` resolves ``dd`` to one resource; ``None``
    for a group-version nothing is served in (the core group always lists)."""
    entries: list[Obj] = []
    for (g, v, plural), info in sorted(kinds.items()):
        if (g, v) != (group, version):
            continue
        entries.append(
            {
                "name": plural,
                "singularName": info["singular"],
                "namespaced": info["namespaced"],
                "kind": info["kind"],
                "verbs": sorted(verbs | {"deletecollection"}),
                **({"shortNames": info["shortnames"]} if info["shortnames"] else {}),
            }
        )
        for sub in sorted(info["subresources"]):
            scale = {"group": "autoscaling", "version": "v1", "kind": "Scale"} if sub == "scale" else {}
            entries.append(
                {
                    "name": f"{plural}/{sub}",
                    "singularName": "",
                    "namespaced": info["namespaced"],
                    "kind": info["kind"],
                    "verbs": ["get", "patch", "update"],
                    **scale,
                }
            )
    if not entries and group:
        return None
    groupversion = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": groupversion, "resources": entries}


def of_crd(crd: Obj) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The kinds a CustomResourceDefinition declares, one per version, as :data:`BUILTIN` describes its kinds (and
    their schemas and printer columns)."""
    spec = crd.get("spec", {})
    names = spec.get("names", {})
    return {
        (spec["group"], version["name"], names["plural"]): {
            "kind": names["kind"],
            "namespaced": spec.get("scope") == "Namespaced",
            "subresources": set(version.get("subresources") or {}),
            "scale": (version.get("subresources") or {}).get("scale"),
            "shortnames": set(names.get("shortNames") or ()),
            "singular": names.get("singular"),
            "schema": (version.get("schema") or {}).get("openAPIV3Schema"),
            "columns": version.get("additionalPrinterColumns"),
        }
        for version in spec.get("versions", [])
    }
