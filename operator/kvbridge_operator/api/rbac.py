"""Every permission the operator needs: its own API calls plus Kopf's watches.

The Helm chart grants exactly these (a test renders the chart and compares),
and the operator tests check that the client never calls anything else.
"""

from __future__ import annotations

#: (API group, resource, verbs)
REQUIRED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("kvbridge.io", "disaggregateddeployments", ("get", "list", "watch", "patch")),
    ("kvbridge.io", "disaggregateddeployments/status", ("patch",)),
    ("kvbridge.io", "disaggregatedroles", ("get", "list", "watch", "create", "patch")),
    ("kvbridge.io", "disaggregatedroles/status", ("patch",)),
    ("apps", "statefulsets", ("get", "list", "watch", "create", "patch", "delete")),
    ("leaderworkerset.x-k8s.io", "leaderworkersets", ("get", "list", "watch", "create", "patch", "delete")),
    ("", "services", ("create", "patch", "delete")),
    ("networking.k8s.io", "networkpolicies", ("create", "patch")),
    ("policy", "poddisruptionbudgets", ("create", "patch", "delete")),
    ("", "secrets", ("create",)),
    ("", "configmaps", ("get",)),  # spec.autoscaling.profile: the planner reads the engines' profile
    ("", "pods", ("list", "watch")),
    ("", "events", ("create",)),
    # the serving path: spec.router (its Role may only read its own deployment) and spec.inferencePool
    ("apps", "deployments", ("create", "patch", "delete")),
    ("", "serviceaccounts", ("create", "patch", "delete")),
    ("rbac.authorization.k8s.io", "roles", ("create", "patch", "delete")),
    ("rbac.authorization.k8s.io", "rolebindings", ("create", "patch", "delete")),
    ("inference.networking.k8s.io", "inferencepools", ("create", "patch", "delete")),
    ("gateway.networking.k8s.io", "httproutes", ("create", "patch", "delete")),
    ("scheduling.x-k8s.io", "podgroups", ("create", "patch", "delete")),
)

#: what Kopf itself calls on top of the operator's client (list+watch of handled resources, annotations)
KOPF: frozenset[tuple[str, str]] = frozenset(
    {
        ("list", "disaggregateddeployments"),
        ("watch", "disaggregateddeployments"),
        ("patch", "disaggregateddeployments"),
        ("list", "pods"),
        ("watch", "pods"),
        ("list", "disaggregatedroles"),
        ("watch", "disaggregatedroles"),
        ("list", "statefulsets"),
        ("watch", "statefulsets"),
        ("list", "leaderworkersets"),
        ("watch", "leaderworkersets"),
    }
)


def allowed_calls() -> set[tuple[str, str]]:
    return {(verb, resource) for _group, resource, verbs in REQUIRED for verb in verbs}
