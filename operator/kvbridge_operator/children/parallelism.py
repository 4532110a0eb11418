"""Data and expert parallelism of a role (``spec.<role>.dataParallelSize``, ``expertParallel``): what runs them.

The KV side of it is the agent core's (``kvbridge_agent.core.parallel``: each DP rank a KV peer with its own engine
id and side-channel port; the compatibility rules refuse expert parallelism without experts). What is checked here
is where they run: vLLM on GPUs, or the synthetic engine (DP only: it has no experts; its DP ranks in its one pod);
a vLLM engine's DP ranks in its one pod or spread evenly over the pods of a LeaderWorkerSet group (multinode.py:
``--data-parallel-start-rank`` on the workers); and ``dataParallelSize x tensorParallelSize / nodes`` GPUs per pod
(placement.py's fit check counts them).
"""

from __future__ import annotations

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec, EngineDevice, EngineKind

#: expert parallelism asked of the synthetic engine, which serves no model (its DP ranks it runs)
PARALLELISM_NEEDS_VLLM = "PARALLELISM_NEEDS_VLLM"
#: data parallelism on vLLM's CPU build, which kvbridge has not run it on
DATA_PARALLEL_ON_CPU = "DATA_PARALLEL_ON_CPU"


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    found: list[Problem] = []
    for role in Role:
        role_spec = spec.role(role)
        dp_field, ep_field = f"spec.{role.value}.dataParallelSize", f"spec.{role.value}.expertParallel"
        dp = role_spec.data_parallel_size
        if spec.engine.kind is not EngineKind.VLLM:  # the synthetic engine runs its DP ranks in its pod
            if role_spec.expert_parallel:
                found.append(
                    Problem(
                        PARALLELISM_NEEDS_VLLM,
                        ep_field,
                        f"{role.value} asks for expert parallelism, and the synthetic engine (kind Agent) serves no "
                        f"model, so it has no experts to shard: set {ep_field}: false, or spec.engine.kind: VLLM",
                    )
                )
            continue
        if dp > 1 and spec.engine.device is EngineDevice.CPU:
            found.append(
                Problem(
                    DATA_PARALLEL_ON_CPU,
                    dp_field,
                    f"{role.value} asks for {dp} data-parallel ranks on vLLM's CPU build, which does not run them "
                    "for a mixture-of-experts model (its CPU communicator has no all_gatherv, which the experts' "
                    "dispatch needs: the first forward fails) and where kvbridge has not run them for a dense one "
                    f"(its core binding gives TP ranks their cores, not DP ranks): set {dp_field}: 1 and run more "
                    "replicas",
                )
            )
    return found
