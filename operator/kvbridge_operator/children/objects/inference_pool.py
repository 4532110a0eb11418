"""``spec.inferencePool.enabled``: a Gateway API Inference Extension ``InferencePool`` (``inference.networking.
k8s.io/v1``) selecting both roles' pods, which carry ``llm-d.ai/role: prefill|decode`` for llm-d's P/D
scheduler (the Endpoint Picker, installed separately and named in the spec), and an ``HTTPRoute`` from a
Gateway when one is named.
"""

from __future__ import annotations

from kvbridge_operator.api.names import (
    INFERENCE_POOL_API,
    LABEL_DEPLOYMENT,
    LABEL_INFERENCE_POOL,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference
from kvbridge_operator.config import OperatorConfig


def inference_pool_children(dd: DisaggregatedDeployment, uid: str, config: OperatorConfig) -> list[Obj]:
    name, namespace = dd.metadata.name, dd.metadata.namespace or "default"
    owner = owner_reference(dd, uid)
    labels = {LABEL_DEPLOYMENT: name}
    pool = dd.spec.inference_pool
    found: list[Obj] = [
        {
            "apiVersion": INFERENCE_POOL_API,
            "kind": "InferencePool",
            "metadata": child_metadata(name, namespace, labels, owner),
            "spec": {
                # both roles' serving pods (not the router's, not multi-node workers); llm-d's P/D scheduler tells
                # them apart by llm-d.ai/role
                "selector": {"matchLabels": {LABEL_INFERENCE_POOL: name}},
                "targetPorts": [{"number": config.engine_http_port}],
                "endpointPickerRef": {
                    "name": pool.endpoint_picker,
                    "kind": "Service",
                    "port": {"number": pool.endpoint_picker_port},
                    "failureMode": "FailClose",
                },
            },
        },
    ]
    if pool.gateway:
        found.append(
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "HTTPRoute",
                "metadata": child_metadata(name, namespace, labels, owner),
                "spec": {
                    "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": pool.gateway}],
                    "rules": [
                        {
                            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                            "backendRefs": [
                                {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}
                            ],
                        }
                    ],
                },
            }
        )
    return found
