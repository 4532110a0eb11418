"""The NetworkPolicy fencing the engine pods: the deployment's own pods, and the HTTP API for allowed namespaces."""

from __future__ import annotations

from kvbridge_operator.api.names import (
    LABEL_API_ACCESS,
    LABEL_DEPLOYMENT,
    LABEL_ROLE,
    network_policy_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference
from kvbridge_operator.config import OperatorConfig


def network_policy(dd: DisaggregatedDeployment, uid: str, config: OperatorConfig) -> Obj:
    """Ingress to every engine pod of the deployment: any port from the deployment's own pods (the side channel, and
    NIXL/UCX, which connects to ports the rank processes pick at run time), and the HTTP API port only from pods
    of the same namespace or of namespaces labelled ``kvbridge.io/api-access: allowed`` (the HTTP API has no
    authentication: it is for the router). Everything else is dropped where policies are enforced."""
    name = dd.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(
            network_policy_name(name),
            dd.metadata.namespace or "default",
            {LABEL_DEPLOYMENT: name},
            owner_reference(dd, uid),
        ),
        "spec": {
            # the engines' pods (they carry a role; the router's pods do not, and are not fenced by this policy)
            "podSelector": {
                "matchLabels": {LABEL_DEPLOYMENT: name},
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "Exists"}],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: name}}}]},
                {
                    "from": [
                        {"podSelector": {}},
                        {"namespaceSelector": {"matchLabels": {LABEL_API_ACCESS: "allowed"}}},
                    ],
                    "ports": [{"protocol": "TCP", "port": config.engine_http_port}],
                },
            ],
        },
    }
