"""``spec.placement.gang``: the PodGroup of the coscheduling plugin that both roles' pods are labelled into
(placement.py renders it)."""

from __future__ import annotations

from kvbridge_operator.api.names import (
    LABEL_DEPLOYMENT,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import placement
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference


def pod_group_children(dd: DisaggregatedDeployment, uid: str) -> list[Obj]:
    name, namespace = dd.metadata.name, dd.metadata.namespace or "default"
    group = placement.pod_group(
        dd.spec, child_metadata(name, namespace, {LABEL_DEPLOYMENT: name}, owner_reference(dd, uid))
    )
    return [group] if group is not None else []
