"""The verdict on a spec: the plan, or every problem that prevents one (compatibility plus the engine's own)."""

from __future__ import annotations

from kvbridge_agent.core import Problem, TransferPlan, plan_or_problems

from . import vllm
from .spec import DisaggregatedDeployment, EngineKind


def verdict_for(dd: DisaggregatedDeployment) -> TransferPlan | list[Problem]:
    spec = dd.spec
    result = plan_or_problems(spec.model, spec.prefill.settings(), spec.decode.settings(), spec.transfer)
    if spec.engine.kind is EngineKind.VLLM:
        engine_problems = vllm.problems(spec)
        if engine_problems:
            return [*result, *engine_problems] if isinstance(result, list) else engine_problems
    return result
