"""The ports an engine pod listens on, and the side-channel range kept clear of them (checked before scheduling).

Each data-parallel rank of a role listens on ``spec.transfer.sideChannelPort + rank``. In the same pod the engine
serves its HTTP API (the operator's ``engineHttpPort``; behind the routing sidecar, vLLM moves to
:data:`~.engines.vllm_serve.VLLM_PORT_BEHIND_SIDECAR` and the sidecar takes the API port) and, with several
data-parallel ranks, vLLM's coordination listens on :data:`~.engines.vllm_serve.DATA_PARALLEL_RPC_PORT`; an engine
over several nodes has its leader's torch.distributed rendezvous on :data:`~.engines.vllm_serve.MASTER_PORT` (each
engine kind lists its pod's ports, ``ports`` of its module). Two listeners on one port is a crash loop, so a
side-channel range holding any of these ports is refused (``SIDE_CHANNEL_PORT_CONFLICT``) with the nearest base that
clears every port of both roles, checked here. On one node vLLM draws its other torch.distributed ports from the free
ones when the engine starts: they are not fixed, so they cannot be checked before scheduling.
"""

from __future__ import annotations

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.config import OperatorConfig

SIDE_CHANNEL_PORT_CONFLICT = "SIDE_CHANNEL_PORT_CONFLICT"
FIELD = "spec.transfer.sideChannelPort"
_MAX_PORT = 65535


def pod_ports(spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig) -> dict[int, str]:
    """The fixed ports one role's engine pod listens on besides the side channel, and what listens there (the
    engine kind's)."""
    return engine_of(spec).ports(spec, role, config)


def _clashes(spec: DisaggregatedDeploymentSpec, config: OperatorConfig, base: int) -> list[tuple[Role, int, str]]:
    found = []
    for role in (Role.PREFILL, Role.DECODE):
        last = base + spec.role(role).data_parallel_size - 1
        found += [(role, port, what) for port, what in pod_ports(spec, role, config).items() if base <= port <= last]
    return found


def clear_base(spec: DisaggregatedDeploymentSpec, config: OperatorConfig, near: int) -> int | None:
    """The base port nearest ``near`` whose ranges (each role's data-parallel ranks) hold none of the pods' ports and
    end by 65535; ``None`` when there is none."""
    widest = max(spec.prefill.data_parallel_size, spec.decode.data_parallel_size)
    highest = _MAX_PORT + 1 - widest
    for distance in range(_MAX_PORT):
        for base in (near + distance, near - distance):
            if 1 <= base <= highest and not _clashes(spec, config, base):
                return base
    return None


def problems(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> list[Problem]:
    """``SIDE_CHANNEL_PORT_CONFLICT`` when a role's side-channel range holds a port its pod already listens on."""
    base = spec.transfer.side_channel_port
    clashes = _clashes(spec, config, base)
    if not clashes:
        return []
    role, port, what = clashes[0]
    dp = spec.role(role).data_parallel_size
    ranks = f"port {base}" if dp == 1 else f"ports {base} to {base + dp - 1} ({dp} data-parallel ranks)"
    fix = clear_base(spec, config, base)
    advice = f"set {FIELD}: {fix}" if fix is not None else "no side-channel base port clears the pods' ports"
    return [
        Problem(
            SIDE_CHANNEL_PORT_CONFLICT,
            FIELD,
            f"{role.value}'s side channel listens on {ranks}, and port {port} is {what} in the same pod: one of "
            f"the two listeners could not bind (a crash loop); {advice}",
        )
    ]
