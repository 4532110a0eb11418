"""The verdict on a spec: the plan, or every problem that prevents one (compatibility plus the engine's own), each
with advice that holds under every check (no suggestion leads to a problem whose advice leads back)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from kvbridge_agent.core import KVBridgeError, Problem, TransferPlan, plan_or_problems
from kvbridge_agent.core.compat import check_pair
from kvbridge_operator.api.objects import with_fields
from kvbridge_operator.api.spec import DisaggregatedDeployment, DisaggregatedDeploymentSpec
from kvbridge_operator.children import multinode, network, placement, ports, template_changes, templates
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.config import OperatorConfig


def spec_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Every check beyond the compatibility rules: what the multi-node layout, the engine kind's data and expert
    parallelism, the placement, the data path's network, the template overlays and the engine kind itself cannot
    run. The fix search (remedy.py) checks its candidates with the same list."""
    kind = engine_of(spec)
    return [
        *multinode.problems(spec),
        *kind.parallelism_problems(spec),
        *placement.problems(spec),
        *network.problems(spec),
        *templates.problems(spec),
        *kind.problems(spec),
    ]


def advisories_for(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """What the engines will run other than the spec asks, without refusing it (a refusal would refuse the defaults):
    ``kvbridge plan`` lists them, the status carries them and a Warning event says so (the engine kind's: for vLLM,
    verification ``Sampled`` with NixlConnector, which has no transfer digest; ``All`` is refused)."""
    return engine_of(spec).advisories(spec)


def verdict_for(dd: DisaggregatedDeployment, config: OperatorConfig | None = None) -> TransferPlan | list[Problem]:
    """The plan, or every problem that prevents one. Once the rules find none, the operator's settings (``config``;
    the defaults for ``kvbridge plan``) are looked at: its GPU resource among the RDMA resources is refused, then
    each role's pod is rendered with and without its template overlay and what the overlay changed of kvbridge's
    values is refused too: the pods run what was checked. The side-channel ports are checked against the ports the
    pods listen on (the API port is the operator's setting)."""
    spec = dd.spec
    result = plan_or_problems(spec.model, spec.prefill.settings(), spec.decode.settings(), spec.transfer)
    more = spec_problems(spec)
    if not more and not isinstance(result, list):
        config = config or OperatorConfig()
        more = network.gpu_resource_problems(spec, config.gpu_resource) + ports.problems(spec, config)
        more = more or template_changes.rendered_problems(dd, result, config)
    if more or isinstance(result, list):
        return [narrowed(problem, spec) for problem in ([*result, *more] if isinstance(result, list) else more)]
    return result


#: one suggested setting in a problem's advice, with the same field's other values: ``spec.x.y: 3 (or 1, 2 or 6)``
_PAIR = re.compile(r"(spec\.[A-Za-z.]+): ([A-Za-z0-9_.-]+?)\.?(?= |,|;|$)(?: \(or ([^)]*)\))?")
_NO_SINGLE_CHANGE = (
    "no value of the fields this rule names suits every other rule here: use the checked fix, which changes "
    "several settings at once"
)


def _value(raw: str) -> Any:
    return int(raw) if raw.isdigit() else raw


def alternatives(message: str) -> tuple[str, list[dict[str, Any]]]:
    """A message's text before its advice, and the changes the advice offers after ``set``: alternatives apart
    (``, or``; a parenthesis lists more values of one field), the settings of one alternative joined by ``and``."""
    start = message.find("set spec.")
    if start < 0:
        return message, []
    found: list[dict[str, Any]] = []
    end = start + 4
    for match in _PAIR.finditer(message, start + 4):
        between = message[end : match.start()]
        if between.strip(" ,;") and "and" not in between.split() and not between.strip(" ,").startswith("or"):
            break  # the advice ended (e.g. "for this rule, but ...")
        path, value, more = match.groups()
        if found and "and" in between.split():
            found[-1][path] = _value(value)
        else:
            found.append({path: _value(value)})
        extras = [e.strip() for e in re.split(r",\s*|\s+or\s+", more or "") if e.strip()]
        if all(re.fullmatch(r"[A-Za-z0-9_.-]+", e) for e in extras):  # else a remark, not values
            found += [{path: _value(e)} for e in extras]
        end = match.end()
    return message[:start], found


def _with(spec: DisaggregatedDeploymentSpec, changes: dict[str, Any]) -> DisaggregatedDeploymentSpec | None:
    data = with_fields({"spec": spec.model_dump(by_alias=True, mode="json")}, changes)
    try:
        return DisaggregatedDeploymentSpec.model_validate(data["spec"])
    except (ValidationError, KVBridgeError, ValueError):
        return None


def _refused(spec: DisaggregatedDeploymentSpec, changes: dict[str, Any]) -> bool:
    """Whether applying ``changes`` leaves a problem at one of the fields it set (the value is refused there)."""
    changed = _with(spec, changes)
    if changed is None:
        return True
    after = check_pair(
        changed.model, changed.prefill.settings(), changed.decode.settings(), changed.transfer, suggestions=False
    ) + spec_problems(changed)
    return any(problem.field in changes for problem in after)


def narrowed(problem: Problem, spec: DisaggregatedDeploymentSpec) -> Problem:
    """``problem`` with the suggestions its own rule makes but another check refuses taken out of its advice
    (e.g. a compatibility rule's decode block size that vLLM's CPU attention cannot run)."""
    head, offered = alternatives(problem.message)
    kept = [changes for changes in offered if not _refused(spec, changes)]
    if len(kept) == len(offered):
        return problem
    advice = ", or ".join(" and ".join(f"{p}: {v}" for p, v in changes.items()) for changes in kept)
    return Problem(problem.code, problem.field, head + (f"set {advice}" if kept else _NO_SINGLE_CHANGE))
