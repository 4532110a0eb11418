"""A role's headless Service: the HTTP port, and for prefill every data-parallel rank's side channel.

The prefill Service is also what decode checks a side channel's host against (``KVBRIDGE_PREFILL_SERVICE``,
docs/protocol.md §5): it publishes its pods before they are ready and while they drain (a decode meets a prefill pod
as soon as the router sends it there, which may be before cluster DNS caught up with its readiness, and reads from a
draining one until its leases end); nothing routes by it (the router reads the deployment's status)."""

from __future__ import annotations

from kvbridge_agent.core import Role
from kvbridge_agent.core.parallel import side_channel_port_of_rank
from kvbridge_operator.api.names import (
    HTTP_PORT_NAME,
    role_name,
    side_channel_port_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import multinode
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference, selector
from kvbridge_operator.config import OperatorConfig


def service(dd: DisaggregatedDeployment, uid: str, role: Role, config: OperatorConfig) -> Obj:
    name = role_name(dd.metadata.name, role)
    ports = [{"name": HTTP_PORT_NAME, "port": config.engine_http_port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]
    if role is Role.PREFILL:  # every data-parallel rank's side channel that a pod declares (the leader's)
        for rank in range(multinode.data_parallel_per_pod(dd.spec.prefill)):
            port_name = side_channel_port_name(rank)
            port = side_channel_port_of_rank(dd.spec.transfer.side_channel_port, rank)
            ports.append({"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            name, dd.metadata.namespace or "default", selector(dd.metadata.name, role), owner_reference(dd, uid)
        ),
        "spec": {
            "clusterIP": "None",
            "selector": selector(dd.metadata.name, role),
            "ports": ports,
            "publishNotReadyAddresses": role is Role.PREFILL,
        },
    }


def dns_name(dd: DisaggregatedDeployment, role: Role, config: OperatorConfig) -> str:
    """The role's Service's DNS name as its deployment's pods resolve it: ``<name>.<namespace>.<serviceDomain>``."""
    return f"{role_name(dd.metadata.name, role)}.{dd.metadata.namespace or 'default'}.{config.service_domain}"
