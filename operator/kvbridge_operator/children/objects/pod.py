"""A role's pod template: what kvbridge renders from the spec and the plan (the engine kind's containers, the
agent's environment, placement, network, termination), the role's overlay merged over it, and its revision."""

from __future__ import annotations

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.parallel import side_channel_port_of_rank
from kvbridge_operator.api.names import (
    KEYS_VOLUME,
    LABEL_DEPLOYMENT,
    LABEL_DP,
    LABEL_DP_LOCAL,
    LABEL_FINGERPRINT,
    LABEL_PAIRING,
    LABEL_REVISION,
    LABEL_TP,
    MANAGED_BY,
    secret_name,
    side_channel_port_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, RoleSpec
from kvbridge_operator.children import multinode, network, placement, termination, tracing, transfer_token
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.objects.service import dns_name
from kvbridge_operator.children.objects.shared import overlay, revision, selector
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.config import OperatorConfig


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
        num_blocks=config.synthetic_num_blocks,
        http_port=config.engine_http_port,
        device="cpu" if kind.on_cpu(spec, config) else "cuda",
        drain_seconds=spec.transfer.drain_seconds,
        transfer_token_file=transfer_token.token_file(spec, role),
        # decode: the side channels it may reach, the pods' networks (prefill advertises its pod IP)
        prefill_hosts=list(config.pod_networks) if role is Role.DECODE and config.pod_networks else None,
        # decode of kvbridge's transfer: only to its deployment's prefill pods, the addresses of their Service
        prefill_service=dns_name(dd, Role.PREFILL, config)
        if role is Role.DECODE and config.service_domain and kind.kvbridge_transfer(spec)
        else None,
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
    termination.apply(template, spec, role, config.engine_http_port)
    transfer_token.apply(template, spec, dd.metadata.name, role)
    return template


def _keys_volume(dd: DisaggregatedDeployment) -> Obj:
    return {"name": KEYS_VOLUME, "secret": {"secretName": secret_name(dd.metadata.name), "defaultMode": 0o400}}
