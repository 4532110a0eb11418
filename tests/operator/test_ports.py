"""The side channel's ports against the ports the engine pods already listen on (children/ports.py): a range that
holds the API port, the sidecar's or vLLM's data-parallel RPC port is refused before scheduling, with a checked
fix."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children import ports
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

SIDECAR = OperatorConfig(routing_sidecar_image="ghcr.io/llm-d/llm-d-routing-sidecar:v0.2.0")


def deployment(base: int, kind: str = "VLLM", dp_prefill: int = 1, dp_decode: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "ports"},
        "spec": {
            "model": {"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64},
            "engine": {"kind": kind},
            "prefill": {"dataParallelSize": dp_prefill},
            "decode": {"dataParallelSize": dp_decode},
            "transfer": {"sideChannelPort": base},
        },
    }


def multinode(base: int) -> dict[str, Any]:
    """Prefill over two nodes (TP 16 of 8 GPUs each, vLLM on GPUs): its leader pod listens on --master-port."""
    doc = deployment(base)
    doc["spec"]["model"] = {"name": "m", "numLayers": 2, "numKVHeads": 16, "headDim": 64}
    doc["spec"]["prefill"] = {"tensorParallelSize": 16, "nodes": 2}
    doc["spec"]["decode"] = {"tensorParallelSize": 16, "nodes": 2}
    doc["spec"]["placement"] = {"gpusPerNode": 8}
    return doc


@pytest.mark.parametrize(
    ("doc", "config", "port"),
    [
        (deployment(8000), OperatorConfig(), 8000),  # beside --port 8000 at DP 1
        (deployment(7995, dp_prefill=8), OperatorConfig(), 8000),  # prefill's 8 ranks reach the API port
        (deployment(29545, dp_prefill=8), OperatorConfig(), 29550),  # beside --data-parallel-rpc-port 29550
        (deployment(8200), SIDECAR, 8200),  # vLLM's port behind the routing sidecar (decode)
        (deployment(9000, kind="Synthetic"), OperatorConfig(engine_http_port=9000), 9000),  # the operator's setting
        (multinode(29500), OperatorConfig(), 29500),  # a two-node engine's leader: torch.distributed's rendezvous
    ],
)
def test_a_side_channel_range_holding_a_pod_port_is_refused_with_a_checked_fix(
    doc: dict[str, Any], config: OperatorConfig, port: int
) -> None:
    found = verdict_for(parse_deployment(doc), config)
    assert isinstance(found, list)
    assert [(p.code, p.field) for p in found] == [(ports.SIDE_CHANNEL_PORT_CONFLICT, ports.FIELD)]
    assert f"port {port} is" in found[0].message
    fix = int(found[0].message.rsplit(f"set {ports.FIELD}: ", 1)[1])
    doc["spec"]["transfer"]["sideChannelPort"] = fix
    assert isinstance(verdict_for(parse_deployment(doc), config), TransferPlan)


def test_ports_the_pod_does_not_open_are_free() -> None:
    # the synthetic engine has no data-parallel RPC port; a prefill pod has no sidecar
    assert isinstance(verdict_for(parse_deployment(deployment(29545, kind="Synthetic", dp_prefill=8))), TransferPlan)
    assert isinstance(verdict_for(parse_deployment(deployment(29550, dp_prefill=1))), TransferPlan)


@settings(max_examples=200, deadline=None)
@given(
    base=st.integers(1, 65535),
    dp_prefill=st.sampled_from([1, 2, 4, 8]),
    dp_decode=st.sampled_from([1, 2, 4, 8]),
    sidecar=st.booleans(),
    http=st.sampled_from([8000, 8080, 5600, 29550]),
)
def test_the_fix_clears_every_port_of_both_roles(
    base: int, dp_prefill: int, dp_decode: int, sidecar: bool, http: int
) -> None:
    spec = parse_deployment(deployment(min(base, 65535 - 8), dp_prefill=dp_prefill, dp_decode=dp_decode)).spec
    config = OperatorConfig(
        engine_http_port=http, routing_sidecar_image=SIDECAR.routing_sidecar_image if sidecar else ""
    )
    fix = ports.clear_base(spec, config, spec.transfer.side_channel_port)
    assert fix is not None
    fixed = spec.model_copy(update={"transfer": spec.transfer.model_copy(update={"side_channel_port": fix})})
    assert ports.problems(fixed, config) == []
    for role in ("prefill", "decode"):
        dp = dp_prefill if role == "prefill" else dp_decode
        used = ports.pod_ports(spec, Role(role), config)
        assert not any(fix <= port < fix + dp for port in used)
    listed = ports.problems(spec, config)
    assert bool(listed) == any(
        spec.transfer.side_channel_port <= port < spec.transfer.side_channel_port + dp
        for role, dp in (("prefill", dp_prefill), ("decode", dp_decode))
        for port in ports.pod_ports(spec, Role(role), config)
    )
