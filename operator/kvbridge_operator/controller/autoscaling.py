"""kvbridge's planner at work: one pass over a deployment with ``spec.autoscaling.enabled``.

Every ``intervalSeconds`` it reads the engines' profile (a ConfigMap), asks Prometheus what the last window's
traffic was (planner.prometheus), decides both roles' sizes (planner.sizing) and writes them to the roles' /scale
— ``spec.replicas`` of each DisaggregatedRole, as HPA or KEDA would — so the operator's bounds and P:D ratio still
apply and a scale-down drains as any other. It writes ``status.autoscaling`` (what it saw, decided and why), a
``Planned`` event when a size changes (with why), a ``PlannerHeld`` Warning when it starts holding (metrics missing,
stale or implausible, or the profile unreadable), ``PlannerResumed`` when it sizes again, a ``TargetUnreachable``
Warning when a target becomes one no engine meets; it exports what it asked for as
``kvbridge_operator_planned_replicas`` (for HPA or KEDA users who would rather act on it themselves), and each pass as
``kvbridge_operator_planner_*`` series: decisions by role, reason and change, what it read, targets, corrections.

A pass that fails changes nothing that runs; a planner that restarts picks its memory up from the status.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import aiohttp
from pydantic import ValidationError

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.autoscaling import AutoscalingSpec
from kvbridge_operator.api.names import role_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.api.status import AutoscalingStatus, PlannedSize, SizeChange
from kvbridge_operator.controller.actions import Event
from kvbridge_operator.controller.apply import post_event
from kvbridge_operator.controller.metrics import (
    PLANNED_REPLICAS,
    PLANNER_CORRECTION,
    PLANNER_DECISIONS,
    PLANNER_LAST_PASS,
    PLANNER_OBSERVED,
    PLANNER_TARGET_SECONDS,
)
from kvbridge_operator.kube import CONFIG_MAPS, DEPLOYMENTS, ROLES, ApiError, KubeClient
from kvbridge_operator.planner.hysteresis import DOWN, UP, Change, Hysteresis
from kvbridge_operator.planner.profile import PerformanceProfile
from kvbridge_operator.planner.prometheus import PrometheusError, observe
from kvbridge_operator.planner.sizing import (
    CORRECTION_RANGE,
    MAX_RATE,
    TARGET_UNREACHABLE,
    Bounds,
    Decision,
    Memory,
    Observation,
    Recommendation,
    Targets,
    decide,
)

log = logging.getLogger(__name__)

#: the planner holds when the profile cannot be read or parsed (docs/autoscaling.md)
PROFILE_INVALID = "ProfileInvalid"


def due(last_pass_at: object, interval_seconds: object, now: float) -> bool:
    """Whether a pass is due ``interval_seconds`` after the last (a value that is no number: due, so that the pass
    reads the deployment afresh and its checks decide)."""
    try:
        return now - float(last_pass_at or 0.0) >= float(interval_seconds) - 0.5  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True


def may_be_due(body: Obj, now: float) -> bool:
    """Whether a pass may be due, from the deployment the timer was handed (no API read): the planner's timer ticks
    every few seconds, and only a pass that may be due reads the deployment afresh."""
    spec = (body.get("spec") or {}).get("autoscaling") or {}
    last = ((body.get("status") or {}).get("autoscaling") or {}).get("lastPassAt")
    return due(last, spec.get("intervalSeconds", AutoscalingSpec().interval_seconds), now)


def memory_of(status: Obj) -> Memory:
    """What the last pass kept in the status (an empty memory for a status that does not parse). The status is
    writable by others than this operator: a correction is taken within ``CORRECTION_RANGE`` and a rate only where
    the planner would believe it (a correction of 0 would divide a capacity by 0)."""
    try:
        last = AutoscalingStatus.model_validate(status)
    except ValidationError:
        return Memory()
    history = tuple(Recommendation(h.at, h.prefill, h.decode) for h in last.history)
    changes = tuple(
        None if c is None else Change(c.at, UP if c.direction == "up" else DOWN)
        for c in (last.prefill_change, last.decode_change)
    )
    rate, since = last.request_rate, last.traffic_since
    return Memory(
        history,
        rate if rate is not None and math.isfinite(rate) and 0 <= rate <= MAX_RATE else None,
        _correction(last.prefill_correction),
        _correction(last.decode_correction),
        (last.prefill, last.decode) if last.last_pass_at > 0 else None,
        (changes[0], changes[1]),
        since if since is not None and math.isfinite(since) and since >= 0 else None,
    )


def _correction(value: float) -> float:
    low, high = CORRECTION_RANGE
    return min(high, max(low, value)) if math.isfinite(value) else 1.0


def hysteresis_of(spec: AutoscalingSpec) -> Hysteresis:
    """planner.hysteresis's settings from ``spec.autoscaling``."""
    return Hysteresis(spec.tolerance_percent / 100, spec.reversal_window_seconds, spec.warmup_seconds)


def _settled(status: Obj) -> tuple[bool, bool]:
    """Whether each role's pods are all ready, as the deployment's status says."""
    roles = [status.get(role.value) or {} for role in Role]
    return (
        int(roles[0].get("readyReplicas", 0)) >= int(roles[0].get("replicas", 0)),
        int(roles[1].get("readyReplicas", 0)) >= int(roles[1].get("replicas", 0)),
    )


async def read_profile(client: KubeClient, namespace: str, spec: AutoscalingSpec) -> PerformanceProfile:
    """The profile in the ConfigMap key ``spec.profile`` names; raises SpecError (PROFILE_INVALID) with the fix, also
    for a profile measured at a lower ITL percentile than the target's (a higher one errs on the safe side)."""
    if spec.profile is None:
        raise SpecError("no profile named", field="spec.autoscaling.profile", code=PROFILE_INVALID)
    where = f"ConfigMap {namespace}/{spec.profile.name} key {spec.profile.key}"
    config_map = await client.get(CONFIG_MAPS, namespace, spec.profile.name)
    text = ((config_map or {}).get("data") or {}).get(spec.profile.key)
    if text is None:
        raise SpecError(f"{where} is missing", field="spec.autoscaling.profile", code=PROFILE_INVALID)
    try:
        profile = PerformanceProfile.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise SpecError(f"{where}: {exc}"[:2000], field="spec.autoscaling.profile", code=PROFILE_INVALID) from exc
    measured, target = profile.decode.itl_percentile, spec.itl.percentile if spec.itl else None
    if measured is not None and target is not None and measured < target:  # a p90 curve would undersize for p99
        raise SpecError(
            f"{where}: its inter-token latencies are p{measured:g}, below the ITL target's p{target:g}: measure "
            f"again with kvbridge profile --itl-percentile {target:g}",
            field="spec.autoscaling.profile",
            code=PROFILE_INVALID,
        )
    return profile


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def status_of(spec: AutoscalingSpec, decision: Decision, observation: Observation | None, now: float) -> Obj:
    ttft, itl = spec.ttft, spec.itl
    targets = (
        ""
        if ttft is None or itl is None
        else (f"TTFT p{ttft.percentile:g} {ttft.milliseconds:g} ms, ITL p{itl.percentile:g} {itl.milliseconds:g} ms")
    )
    seen = observation
    status = AutoscalingStatus(
        state=decision.reason,
        message=decision.message[:4096],
        held=decision.held,
        targets=targets,
        planned=f"{decision.prefill}/{decision.decode}",
        prefill=decision.prefill,
        decode=decision.decode,
        request_rate=None if seen is None else _finite(seen.request_rate),
        predicted_rate=None if decision.held else _finite(decision.predicted_rate),
        prompt_tokens=None if seen is None else _finite(seen.prompt_tokens),
        output_tokens=None if seen is None else _finite(seen.output_tokens),
        prefix_hit_rate=None if seen is None else _finite(seen.prefix_hit_rate),
        ttft_ms=None if seen is None else _finite(seen.ttft_ms),
        itl_ms=None if seen is None else _finite(seen.itl_ms),
        prefill_correction=decision.memory.prefill_correction,
        decode_correction=decision.memory.decode_correction,
        history=[PlannedSize(at=r.at, prefill=r.prefill, decode=r.decode) for r in decision.memory.history],
        prefill_change=_change(decision.memory.changes[0]),
        decode_change=_change(decision.memory.changes[1]),
        last_pass_at=now,
        traffic_since=decision.memory.traffic_since,
    )
    return status.model_dump(by_alias=True, mode="json")


def _change(change: Change | None) -> SizeChange | None:
    return None if change is None else SizeChange(at=change.at, direction="up" if change.direction == UP else "down")


async def plan_pass(
    client: KubeClient, session: aiohttp.ClientSession, body: Obj, now: float | None = None
) -> Decision | None:
    """One pass over the deployment ``body`` (None: not due, planner off, or a spec that does not parse)."""
    now = time.time() if now is None else now
    try:
        dd = parse_deployment(body)
    except SpecError:
        return None  # the reconcile reports it
    spec = dd.spec.autoscaling
    previous: Obj = (body.get("status") or {}).get("autoscaling") or {}
    if not spec.enabled or spec.ttft is None or spec.itl is None:
        return None
    if not due(previous.get("lastPassAt"), spec.interval_seconds, now):
        return None
    namespace = dd.metadata.namespace or "default"
    status = body.get("status") or {}
    running = Recommendation(
        now, int((status.get("prefill") or {}).get("replicas", 0)), int((status.get("decode") or {}).get("replicas", 0))
    )
    memory = memory_of(previous)
    observation: Observation | None = None
    try:
        profile = await read_profile(client, namespace, spec)
    except SpecError as exc:
        decision = Decision(running.prefill, running.decode, PROFILE_INVALID, exc.message, True, memory=memory)
    else:
        unavailable = ""
        window = f"{spec.window_seconds}s"
        try:
            observation = await observe(
                session,
                spec.prometheus_url,
                namespace,
                dd.metadata.name,
                window,
                spec.ttft.percentile,
                spec.itl.percentile,
            )
        except PrometheusError as exc:  # its message quotes nothing of an answer but Prometheus' own error, cut
            unavailable = f"Prometheus at {spec.prometheus_url}: {exc.code}: {exc.message}"
        bounds = tuple(Bounds(dd.spec.role(r).min_replicas, dd.spec.role(r).max_replicas) for r in Role)
        decision = decide(
            observation,
            unavailable,
            Targets(spec.ttft.milliseconds, spec.itl.milliseconds, spec.ttft.percentile, spec.headroom_percent / 100),
            profile,
            running,
            (bounds[0], bounds[1]),
            memory,
            now,
            spec.interval_seconds,
            spec.stabilization_window_seconds,
            spec.window_seconds,
            hysteresis=hysteresis_of(spec),
            settled=_settled(status),
        )
    export(namespace, dd.metadata.name, spec, decision, observation, running)
    if not decision.held:
        await _scale(client, dd, decision)
    await client.patch(
        DEPLOYMENTS,
        namespace,
        dd.metadata.name,
        {"status": {"autoscaling": status_of(spec, decision, observation, now)}},
        "status",
    )
    await _events(client, body, previous, decision)
    return decision


async def _scale(client: KubeClient, dd: DisaggregatedDeployment, decision: Decision) -> None:
    """Ask each role for its size through its /scale (spec.replicas), where it differs."""
    namespace, name = dd.metadata.namespace or "default", dd.metadata.name
    for role, wanted in ((Role.PREFILL, decision.prefill), (Role.DECODE, decision.decode)):
        PLANNED_REPLICAS.labels(namespace=namespace, deployment=name, role=role.value).set(wanted)
        current = await client.get(ROLES, namespace, role_name(name, role))
        if current is None or (current.get("spec") or {}).get("replicas") == wanted:
            continue
        meta = current.get("metadata") or {}
        try:
            patch: Any = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "spec": {"replicas": wanted}}
            await client.patch(ROLES, namespace, role_name(name, role), patch)
        except ApiError as exc:  # changed in between (a person's kubectl scale): the next pass sees it
            log.info("planner: scaling %s/%s: %s", namespace, role_name(name, role), exc)


def export(
    namespace: str,
    name: str,
    spec: AutoscalingSpec,
    decision: Decision,
    observation: Observation | None,
    running: Recommendation,
) -> None:
    """The pass as the operator's metrics (controller/metrics.py): the decision per role and its change of the size
    running, what was read (NaN: not read this pass), the targets, the corrections and the time of the pass."""
    memory = decision.memory
    for role, was, wanted, correction in (
        (Role.PREFILL, running.prefill, decision.prefill, memory.prefill_correction),
        (Role.DECODE, running.decode, decision.decode, memory.decode_correction),
    ):
        change = "up" if wanted > was else "down" if wanted < was else "none"
        PLANNER_DECISIONS.labels(namespace, name, role.value, decision.reason, change).inc()
        PLANNER_CORRECTION.labels(namespace, name, role.value).set(correction)
    seen = observation
    nan = math.nan
    figures = {
        "request_rate": nan if seen is None else seen.request_rate,
        "predicted_rate": nan if decision.held else decision.predicted_rate,
        "prompt_tokens": nan if seen is None else seen.prompt_tokens,
        "output_tokens": nan if seen is None else seen.output_tokens,
        "prefix_hit_rate": nan if seen is None else seen.prefix_hit_rate,
        "decode_running": nan if seen is None else seen.decode_running,
        "ttft_seconds": nan if seen is None or seen.ttft_ms is None else seen.ttft_ms / 1000,
        "itl_seconds": nan if seen is None or seen.itl_ms is None else seen.itl_ms / 1000,
    }
    for figure, value in figures.items():
        PLANNER_OBSERVED.labels(namespace, name, figure).set(value)
    for target, latency in (("ttft", spec.ttft), ("itl", spec.itl)):
        if latency is not None:
            PLANNER_TARGET_SECONDS.labels(namespace, name, target, f"{latency.percentile:g}").set(
                latency.milliseconds / 1000
            )
    PLANNER_LAST_PASS.labels(namespace, name).set(running.at)


async def _events(client: KubeClient, body: Obj, previous: Obj, decision: Decision) -> None:
    """``PlannerHeld`` (Warning) when it starts holding, ``PlannerResumed`` when it sizes again after holding,
    ``TargetUnreachable`` (Warning) when a target becomes one even an idle engine misses, ``Planned`` when a size
    changes, with why."""
    involved = body.get("metadata") or {}
    state, sizes = previous.get("state"), (previous.get("prefill"), previous.get("decode"))
    if decision.held:
        if state != decision.reason:
            held = Event("Warning", "PlannerHeld", f"{decision.reason}: {decision.message}")
            await post_event(client, involved, held)
        return
    if previous.get("held") is True:
        await post_event(client, involved, Event("Normal", "PlannerResumed", f"{state} no more: {decision.message}"))
    if decision.reason == TARGET_UNREACHABLE and state != TARGET_UNREACHABLE:
        await post_event(client, involved, Event("Warning", TARGET_UNREACHABLE, decision.message))
    if sizes != (decision.prefill, decision.decode):
        was = "" if None in sizes else f" (was {sizes[0]}/{sizes[1]})"
        message = f"{decision.prefill} prefill, {decision.decode} decode{was}: {decision.message}"
        await post_event(client, involved, Event("Normal", "Planned", message))
