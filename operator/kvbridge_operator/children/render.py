"""Pure functions from a DisaggregatedDeployment to its desired children.

Every child is a plain dict (the object as it would be sent to the API
server) with labels, an owner reference and no server-set fields, so the
same output is what the tests validate with kubernetes-validate and what
the reconciler creates or patches.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from typing import Any

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.parallel import side_channel_port_of_rank
from kvbridge_operator.api.names import (
    API_VERSION,
    HTTP_PORT_NAME,
    KEYS_VOLUME,
    KIND,
    LABEL_API_ACCESS,
    LABEL_DEPLOYMENT,
    LABEL_DP,
    LABEL_DP_LOCAL,
    LABEL_FINGERPRINT,
    LABEL_PAIRING,
    LABEL_REVISION,
    LABEL_ROLE,
    LABEL_TP,
    MANAGED_BY,
    network_policy_name,
    role_name,
    secret_name,
    side_channel_port_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, RoleSpec
from kvbridge_operator.children import multinode, network, placement, termination, tracing, transfer_token
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.keys import curve_keypair
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.config import OperatorConfig


def selector(deployment: str, role: Role) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role.value}


def owner_reference(dd: DisaggregatedDeployment, uid: str) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": dd.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(name: str, namespace: str, labels: dict[str, str], owner: Obj) -> Obj:
    return {"name": name, "namespace": namespace, "labels": {**MANAGED_BY, **labels}, "ownerReferences": [owner]}


#: Kubernetes' strategic-merge keys of the lists in a pod template (what `kubectl patch` merges by)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "readinessGates": "conditionType",
}


def overlay(base: Any, patch: Any, key: str = "") -> Any:
    """Merge a user overlay into a rendered object as a strategic merge patch would: dicts deeply, lists of a
    pod template by their merge key (containers and env by name, ports by containerPort, mounts by mountPath,
    ...), other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            merged[name] = overlay(base[name], value, name) if name in base else copy.deepcopy(value)
        return merged
    merge_key = MERGE_KEYS.get(key, "name")
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and merge_key in x for x in [*base, *patch])
    ):
        merged_list = [copy.deepcopy(x) for x in base]
        index = {x[merge_key]: i for i, x in enumerate(merged_list)}
        for item in patch:
            if item[merge_key] in index:
                merged_list[index[item[merge_key]]] = overlay(merged_list[index[item[merge_key]]], item)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def revision(template: Obj) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def template_revision(workload: Obj) -> str:
    """The revision label of a workload's pod template (what its pods carry once they run it; a LeaderWorkerSet's
    leader and workers are rendered from one template and carry the same)."""
    spec = workload["spec"]
    template = spec["leaderWorkerTemplate"]["workerTemplate"] if "leaderWorkerTemplate" in spec else spec["template"]
    return str(template["metadata"].get("labels", {}).get(LABEL_REVISION, ""))


def engine_env(dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig) -> list[Obj]:
    """The environment contract for one role's pods; pod name and IP come from the downward API."""
    spec = dd.spec
    kind = engine_of(spec)
    environment = EngineEnvironment(
        role=role,
        deployment=dd.metadata.name,
        engine_id="from-downward-api",
        model=spec.model,
        prefill=spec.prefill.settings(),
        decode=spec.decode.settings(),
        transfer=spec.transfer,
        side_channel_host="from-downward-api",
        fingerprint=plan.fingerprint,
        keys_dir=config.keys_mount_path if kind.kvbridge_transfer(spec) else "",
        num_blocks=config.agent_num_blocks,
        http_port=config.agent_http_port,
        device="cpu" if kind.on_cpu(spec, config) else "cuda",
        drain_seconds=spec.transfer.drain_seconds,
        transfer_token_file=transfer_token.token_file(spec, role),
    )
    downward = {"KVBRIDGE_ENGINE_ID": "metadata.name", "KVBRIDGE_SIDE_CHANNEL_HOST": "status.podIP"}
    env: list[Obj] = []
    for name, value in render_environment(environment).items():
        if name in downward:
            env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": downward[name]}}})
        else:
            env.append({"name": name, "value": value})
    return env + tracing.env_list(spec, tracing.service_name(dd.metadata.name, role.value))


def pod_template(
    dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig, key: str | None = None
) -> Obj:
    """The role's pod template: what kvbridge renders (:func:`rendered_template`), the role's template overlay
    merged over it, and the revision label (the hash of the result)."""
    template = rendered_template(dd, role, plan, config, key)
    overlaid = dd.spec.role(role).template
    template = overlay(template, overlaid) if overlaid else template
    template["metadata"].setdefault("labels", {})[LABEL_REVISION] = revision(template)
    return template


def rendered_template(
    dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig, key: str | None = None
) -> Obj:
    """The role's pod template as kvbridge renders it from the spec and the plan, before the role's overlay."""
    spec = dd.spec
    role_spec: RoleSpec = spec.role(role)
    # one side channel per data-parallel rank, on base port + rank (vLLM's NixlConnector and kvbridge's connector)
    side_channels: list[Obj] = [
        {
            "name": side_channel_port_name(rank),
            "containerPort": side_channel_port_of_rank(spec.transfer.side_channel_port, rank),
            "protocol": "TCP",
        }
        for rank in range(multinode.data_parallel_per_pod(role_spec))  # the leader's, with DP over nodes
    ]
    group_labels = placement.pod_group_labels(spec, dd.metadata.name)
    placed = placement.pod_fields(spec, dd.metadata.name, selector(dd.metadata.name, role), LABEL_DEPLOYMENT)
    labels = {
        **MANAGED_BY,
        **selector(dd.metadata.name, role),
        LABEL_FINGERPRINT: plan.fingerprint,
        LABEL_PAIRING: key or pairing(spec),
        LABEL_TP: str(role_spec.tensor_parallel_size),
        **({LABEL_DP: str(role_spec.data_parallel_size)} if role_spec.data_parallel_size > 1 else {}),
        **(
            {LABEL_DP_LOCAL: str(multinode.data_parallel_per_pod(role_spec))}
            if role_spec.data_parallel_size > 1 and role_spec.nodes > 1
            else {}
        ),
        **group_labels,
    }
    kind = engine_of(spec)
    containers, volumes = kind.pod(
        dd, role, plan, config, engine_env(dd, role, plan, config), side_channels, _keys_volume(dd)
    )
    labels.update(kind.pod_labels(spec, role, config, dd.metadata.name))
    template: Obj = {
        "metadata": {"labels": labels},
        "spec": {"containers": containers, "volumes": volumes, **placed},
    }
    network.apply(template, spec)
    termination.apply(template, spec, role, config.agent_http_port)
    transfer_token.apply(template, spec, dd.metadata.name, role)
    return template


def _keys_volume(dd: DisaggregatedDeployment) -> Obj:
    return {"name": KEYS_VOLUME, "secret": {"secretName": secret_name(dd.metadata.name), "defaultMode": 0o400}}


def stateful_set(
    dd: DisaggregatedDeployment,
    uid: str,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    key: str | None = None,
) -> Obj:
    """The role's StatefulSet with the spec's replicas and partition 0; the reconcile sets both to the rollout's
    step (the effective count of scaling.py plus a surge; the ordinal from which pods run this template)."""
    name = role_name(dd.metadata.name, role)
    namespace = dd.metadata.namespace or "default"
    role_spec = dd.spec.role(role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(name, namespace, selector(dd.metadata.name, role), owner_reference(dd, uid)),
        "spec": {
            "replicas": role_spec.replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
            "selector": {"matchLabels": selector(dd.metadata.name, role)},
            "template": pod_template(dd, role, plan, config, key),
        },
    }


def leader_worker_set(
    dd: DisaggregatedDeployment,
    uid: str,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    key: str | None = None,
) -> Obj:
    """A multi-node role's LeaderWorkerSet (``spec.<role>.nodes`` above 1): the spec's replicas as groups of
    ``nodes`` pods, the role's rollout as the LWS's rolling update."""
    name = role_name(dd.metadata.name, role)
    role_spec = dd.spec.role(role)
    metadata = child_metadata(
        name, dd.metadata.namespace or "default", selector(dd.metadata.name, role), owner_reference(dd, uid)
    )
    return multinode.leader_worker_set(
        metadata,
        role_spec.replicas,
        role_spec.nodes,
        pod_template(dd, role, plan, config, key),
        role_spec.rollout.max_surge,
        role_spec.rollout.max_unavailable,
        data_parallel=role_spec.data_parallel_size,
    )


def service(dd: DisaggregatedDeployment, uid: str, role: Role, config: OperatorConfig) -> Obj:
    name = role_name(dd.metadata.name, role)
    ports = [{"name": HTTP_PORT_NAME, "port": config.agent_http_port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]
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
            "publishNotReadyAddresses": False,
        },
    }


def secret(dd: DisaggregatedDeployment, uid: str) -> Obj:
    """A fresh side-channel key pair; created once, never patched (rotation is an explicit action)."""
    public, private = curve_keypair()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(
            secret_name(dd.metadata.name),
            dd.metadata.namespace or "default",
            {LABEL_DEPLOYMENT: dd.metadata.name},
            owner_reference(dd, uid),
        ),
        "data": {"curve-public": base64.b64encode(public).decode(), "curve-secret": base64.b64encode(private).decode()},
    }


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
                    "ports": [{"protocol": "TCP", "port": config.agent_http_port}],
                },
            ],
        },
    }


def pod_disruption_budget(dd: DisaggregatedDeployment, uid: str, role: Role) -> Obj:
    """Voluntary disruptions (node drains) take one pod of a role at a time. A role of one replica can still be
    drained (a budget that forbids it would block the drain forever): give it two to keep it up."""
    name = role_name(dd.metadata.name, role)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(
            name, dd.metadata.namespace or "default", selector(dd.metadata.name, role), owner_reference(dd, uid)
        ),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(dd.metadata.name, role)}},
    }


def desired_children(
    dd: DisaggregatedDeployment, uid: str, plan: TransferPlan, config: OperatorConfig, key: str | None = None
) -> list[Obj]:
    """Every child except the Secret (created once, see :func:`secret`) and the DisaggregatedRoles (scaling.py)."""
    return [
        service(dd, uid, Role.PREFILL, config),
        service(dd, uid, Role.DECODE, config),
        network_policy(dd, uid, config),
        pod_disruption_budget(dd, uid, Role.PREFILL),
        pod_disruption_budget(dd, uid, Role.DECODE),
        workload(dd, uid, Role.PREFILL, plan, config, key),
        workload(dd, uid, Role.DECODE, plan, config, key),
    ]


def workload(
    dd: DisaggregatedDeployment,
    uid: str,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    key: str | None = None,
) -> Obj:
    """What runs the role's engines: a StatefulSet (an engine is a pod), or a LeaderWorkerSet for an engine that
    spans nodes (an engine is a group of pods)."""
    if multinode.spans_nodes(dd.spec, role):
        return leader_worker_set(dd, uid, role, plan, config, key)
    return stateful_set(dd, uid, role, plan, config, key)
