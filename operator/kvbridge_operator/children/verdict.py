"""The verdict on a spec: the plan, or every problem that prevents one (compatibility plus the engine's own)."""

from __future__ import annotations

from kvbridge_agent.core import Problem, TransferPlan, plan_or_problems
from kvbridge_operator.api.spec import DisaggregatedDeployment, DisaggregatedDeploymentSpec, EngineKind
from kvbridge_operator.children import multinode, placement, templates
from kvbridge_operator.children import vllm_engine as vllm


def spec_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Every check beyond the compatibility rules: what the multi-node layout, the placement, the template overlays
    and (for vLLM) the engine cannot run. The fix search (remedy.py) checks its candidates with the same list."""
    found = [*multinode.problems(spec), *placement.problems(spec), *templates.problems(spec)]
    if spec.engine.kind is EngineKind.VLLM:
        found += vllm.problems(spec)
    return found


def verdict_for(dd: DisaggregatedDeployment) -> TransferPlan | list[Problem]:
    spec = dd.spec
    result = plan_or_problems(spec.model, spec.prefill.settings(), spec.decode.settings(), spec.transfer)
    more = spec_problems(spec)
    if more:
        return [*result, *more] if isinstance(result, list) else more
    return result
