"""Rollouts that keep prefill/decode working: which strategy, and the next step of each role's workload.

Pure and level-triggered: every reconcile looks at the pods that exist (their pairing key, whether they run
the role's current template, whether they are ready) and computes, from nothing else, each workload's
``replicas`` and partition (pods with an ordinal at or above the partition run the new template; the StatefulSet
controller replaces one pod at a time, highest ordinal first; a LeaderWorkerSet numbers and replaces its groups
the same way, so one step serves both kinds).

The strategy follows from the compatibility of every prefill key present with every decode key present (the
new spec's key included), judged with the same verdict as any spec:

* **InPlace** when every such pair is compatible: the roles roll one after the other (prefill first), each
  with ``maxSurge`` extra pods and at most ``maxUnavailable`` of its count missing.
* **BlueGreen** otherwise: the new prefill comes up beside the old (surge of a full set), then the new
  decode; old decode pods are retired only when both new sets are ready, then old prefill pods, then the
  surge goes. At every instant a ready decode pod has a ready prefill pod it is compatible with.

Every pair of keys the operator has checked compatible is published (``status.rollout.pairings``), so a
router pairs a prefill and a decode pod only when their keys are listed together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import LABEL_PAIRING, LABEL_REVISION, LABEL_ROLE, LWS_KIND, WORKLOAD_KINDS, role_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.api.status import Pairing, RolloutStatus
from kvbridge_operator.children.objects.shared import template_revision
from kvbridge_operator.children.scaling import Scale
from kvbridge_operator.controller.actions import Event
from kvbridge_operator.controller.observe import pod_ready

ORDER = (Role.PREFILL, Role.DECODE)


class Strategy(StrEnum):
    IN_PLACE = "InPlace"
    BLUE_GREEN = "BlueGreen"


class Phase(StrEnum):
    COMPLETE = "Complete"
    ROLLING_PREFILL = "RollingPrefill"
    ROLLING_DECODE = "RollingDecode"
    SURGING_PREFILL = "SurgingPrefill"
    SURGING_DECODE = "SurgingDecode"
    RETIRING_DECODE = "RetiringDecode"
    RETIRING_PREFILL = "RetiringPrefill"
    SCALING_IN = "ScalingIn"


@dataclass(frozen=True)
class PodState:
    ordinal: int
    new: bool  # runs the role's current template (its revision label is the StatefulSet's)
    ready: bool
    pairing: str


@dataclass(frozen=True)
class RoleTarget:
    """One role as the rollout sees it: its effective count, surge and unavailability allowance, and the
    partition its StatefulSet has now (``None``: no StatefulSet, or one of an older template)."""

    count: int
    max_surge: int = 1
    max_unavailable: int = 0
    partition: int | None = None


@dataclass(frozen=True)
class Step:
    strategy: Strategy
    phase: Phase
    replicas: dict[Role, int]
    partition: dict[Role, int]
    pairings: list[tuple[str, str]]
    reason: str = ""
    progress: dict[Role, str] = field(default_factory=dict)

    def target(self, role: Role) -> tuple[int, int]:
        """The role's workload as this step wants it: (replicas, partition)."""
        return self.replicas[role], self.partition[role]


def choose(
    prefill_keys: set[str], decode_keys: set[str], compatible: Callable[[str, str], str | None]
) -> tuple[Strategy, list[tuple[str, str]], str]:
    """The strategy for the keys present, the compatible pairs, and why not in place. ``compatible(p, d)``
    returns ``None`` for a compatible pair, else the reason it is not."""
    pairs, reasons = [], []
    for p in sorted(prefill_keys):
        for d in sorted(decode_keys):
            problem = compatible(p, d)
            if problem is None:
                pairs.append((p, d))
            else:
                reasons.append(f"prefill {p} with decode {d}: {problem}")
    return (Strategy.BLUE_GREEN if reasons else Strategy.IN_PLACE), pairs, "; ".join(reasons)


def _old(pods: Sequence[PodState]) -> bool:
    return any(not p.new for p in pods)


def _surge_ready(pods: Sequence[PodState], count: int) -> bool:
    """The full new set beside the old one: ordinals count .. 2*count-1 exist, run the new template, ready."""
    surge = {p.ordinal: p for p in pods if p.ordinal >= count}
    return all(o in surge and surge[o].new and surge[o].ready for o in range(count, 2 * count))


def _roll(target: RoleTarget, pods: Sequence[PodState]) -> int:
    """The next partition of a role rolling in place: lowered only when every pod at or above it runs the new
    template and is ready, and by no more than keeps ``count - maxUnavailable`` pods ready."""
    top = target.count + target.max_surge
    partition = target.count if target.partition is None else min(target.partition, target.count)
    above = [p for p in pods if partition <= p.ordinal < top]
    settled = len(above) == top - partition and all(p.new and p.ready for p in above)
    if not settled or partition == 0:
        return partition
    ready = sum(1 for p in pods if p.ready and p.ordinal < top)
    room = ready - (target.count - target.max_unavailable)
    return max(0, partition - room) if room >= 1 else partition


def _progress(pods: Sequence[PodState], count: int) -> str:
    new = sum(1 for p in pods if p.new and p.ready)
    return f"{new}/{count} new ready" + (f", {sum(1 for p in pods if not p.new)} old" if _old(pods) else "")


def step(
    targets: Mapping[Role, RoleTarget],
    pods: Mapping[Role, Sequence[PodState]],
    new_key: str,
    compatible: Callable[[str, str], str | None],
) -> Step:
    """Each StatefulSet's replicas and partition now, the phase, the strategy and the compatible pairs."""
    keys = {role: {p.pairing for p in pods[role]} | {new_key} for role in Role}
    strategy, pairs, reason = choose(keys[Role.PREFILL], keys[Role.DECODE], compatible)
    count = {role: targets[role].count for role in Role}
    replicas, partition = dict(count), dict.fromkeys(Role, 0)
    progress = {role: _progress(pods[role], count[role]) for role in Role}
    old = {role: _old(pods[role]) for role in Role}

    def result(phase: Phase) -> Step:
        return Step(strategy, phase, replicas, partition, pairs, reason, progress)

    if not any(old.values()):
        extra = any(p.ordinal >= count[role] for role in Role for p in pods[role])
        return result(Phase.SCALING_IN if extra else Phase.COMPLETE)
    if strategy is Strategy.IN_PLACE:
        rolling = next(role for role in ORDER if old[role])
        for role in Role:  # a role waiting for its turn keeps every pod on its old template
            partition[role] = count[role] if old[role] else 0
        replicas[rolling] = count[rolling] + targets[rolling].max_surge
        partition[rolling] = _roll(targets[rolling], pods[rolling])
        return result(Phase.ROLLING_PREFILL if rolling is Role.PREFILL else Phase.ROLLING_DECODE)
    # blue/green: a full new set of each role that changed, prefill first, before any old pod goes
    for role in Role:
        if old[role]:
            replicas[role], partition[role] = 2 * count[role], count[role]
    if old[Role.PREFILL] and not _surge_ready(pods[Role.PREFILL], count[Role.PREFILL]):
        replicas[Role.DECODE], partition[Role.DECODE] = count[Role.DECODE], count[Role.DECODE]
        return result(Phase.SURGING_PREFILL)
    if old[Role.DECODE] and not _surge_ready(pods[Role.DECODE], count[Role.DECODE]):
        return result(Phase.SURGING_DECODE)
    if old[Role.DECODE]:
        partition[Role.DECODE] = 0
        return result(Phase.RETIRING_DECODE)
    replicas[Role.DECODE] = max(count[Role.DECODE], max((p.ordinal + 1 for p in pods[Role.DECODE]), default=0))
    partition[Role.PREFILL] = 0
    return result(Phase.RETIRING_PREFILL)


# -- the rollout of a deployment's workloads (StatefulSets, or LeaderWorkerSets for engines spanning nodes) ----------
def rolling_keys(workload: Obj) -> tuple[str, str]:
    """Where a workload keeps its rolling update's partition: a StatefulSet's ``updateStrategy.rollingUpdate``, a
    LeaderWorkerSet's ``rolloutStrategy.rollingUpdateConfiguration`` (both count ordinals: pods, or groups)."""
    if workload.get("kind") == LWS_KIND:
        return "rolloutStrategy", "rollingUpdateConfiguration"
    return "updateStrategy", "rollingUpdate"


def state_of(workload: Obj | None) -> tuple[int, int] | None:
    """A workload's replicas and partition (``None``: none yet)."""
    if workload is None:
        return None
    spec = workload.get("spec") or {}
    strategy, rolling = rolling_keys(workload)
    partition = ((spec.get(strategy) or {}).get(rolling) or {}).get("partition", 0)
    return int(spec.get("replicas", 0)), int(partition)


def workload_of(rendered: list[Obj], role: Role) -> Obj:
    """The role's workload among the rendered children: its StatefulSet or LeaderWorkerSet."""
    return next(
        c for c in rendered if c["kind"] in WORKLOAD_KINDS and c["metadata"]["labels"][LABEL_ROLE] == role.value
    )


def for_workloads(
    dd: DisaggregatedDeployment,
    key: str,
    rendered: list[Obj],
    scale: Scale,
    workloads: dict[Role, Obj | None],
    pods: list[Obj],
    pairs_with: Callable[[str, str], str | None],
) -> Step:
    """The step for the pods that exist: each workload's replicas and partition (``rendered``: the children the spec
    renders; ``workloads``: each role's workload as it is now; ``key``: the spec's pairing key)."""
    name = dd.metadata.name
    targets, states = {}, {}
    for role in Role:
        new = template_revision(workload_of(rendered, role))
        running, current = workloads[role], state_of(workloads[role])
        partition = (
            current[1] if running is not None and current is not None and template_revision(running) == new else None
        )
        spec = dd.spec.role(role).rollout
        targets[role] = RoleTarget(scale.effective[role], spec.max_surge, spec.max_unavailable, partition)
        prefix = role_name(name, role) + "-"
        states[role] = [
            PodState(
                int(pod["metadata"]["name"][len(prefix) :]),
                labels.get(LABEL_REVISION) == new,
                pod_ready(pod),
                str(labels.get(LABEL_PAIRING, "")),
            )
            for pod in pods
            if (labels := pod["metadata"].get("labels") or {}).get(LABEL_ROLE) == role.value
            and pod["metadata"]["name"].startswith(prefix)
            and pod["metadata"]["name"][len(prefix) :].isdigit()
        ]
    return step(targets, states, key, pairs_with)


def stepped(rendered: list[Obj], roll: Step) -> list[Obj]:
    """The rendered children with each workload's replicas and partition as the step wants."""
    for role in Role:
        workload = workload_of(rendered, role)
        strategy, rolling = rolling_keys(workload)
        workload["spec"]["replicas"], workload["spec"][strategy][rolling]["partition"] = roll.target(role)
    return rendered


def status_of(roll: Step, key: str) -> Obj:
    """``status.rollout``."""
    return RolloutStatus(
        strategy=roll.strategy.value,
        phase=roll.phase.value,
        revision=key,
        reason=roll.reason[:4096],
        prefill=roll.progress.get(Role.PREFILL, ""),
        decode=roll.progress.get(Role.DECODE, ""),
        pairings=[Pairing(prefill=p, decode=d) for p, d in roll.pairings],
    ).model_dump(by_alias=True, mode="json")


def events_of(previous: Obj, roll: Step) -> list[Event]:
    """An event when a rollout starts (with its strategy and why), per phase, and when it completes."""
    was, now = str(previous.get("phase") or Phase.COMPLETE.value), roll.phase.value
    if was == now:
        return []
    progress = f"prefill {roll.progress.get(Role.PREFILL, '')}, decode {roll.progress.get(Role.DECODE, '')}"
    if now == Phase.COMPLETE.value:
        return [Event("Normal", "RolloutComplete", f"every pod runs the current spec ({progress})")]
    events = []
    if was == Phase.COMPLETE.value:
        why = roll.reason or "old and new pods of both roles are compatible"
        events.append(Event("Normal", "RolloutStarted", f"{roll.strategy.value}: {why}"))
    events.append(Event("Normal", "RolloutPhase", f"{roll.strategy.value} {now}: {progress}"))
    return events


@dataclass(frozen=True)
class Advance:
    """The rollout's part of a reconcile: one step further."""

    rendered: list[Obj]  # the rendered children, each workload with the step's replicas and partition
    moving: set[Role]  # roles whose workload exists and is not yet where the step wants it
    status: Obj  # status.rollout
    events: list[Event]


def advance(
    dd: DisaggregatedDeployment,
    key: str,
    rendered: list[Obj],
    scale: Scale,
    workloads: dict[Role, Obj | None],
    pods: list[Obj],
    pairs_with: Callable[[str, str], str | None],
    before: Obj,
) -> Advance:
    """The step for the pods that exist, the rendered children stepped, and the rollout's status and events
    (``before``: the previous ``status.rollout``)."""
    roll = for_workloads(dd, key, rendered, scale, workloads, pods, pairs_with)
    moving = {role for role in Role if workloads[role] is not None and state_of(workloads[role]) != roll.target(role)}
    stepped(rendered, roll)
    if roll.phase in (Phase.SCALING_IN, Phase.COMPLETE) and before.get("revision") == key:
        # no old pod is left, so the step alone cannot tell how they went: the strategy stays the rollout's
        roll = dataclasses.replace(
            roll, strategy=Strategy(before.get("strategy") or roll.strategy), reason=str(before.get("reason") or "")
        )
    return Advance(rendered, moving, status_of(roll, key), events_of(before, roll))
