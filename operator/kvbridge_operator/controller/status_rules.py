"""Pure: the status's conditions and the events they call for, as a table of small rules.

Each rule is a function of :class:`Seen` (what observe.py read and counted) that returns one condition of its type
(:data:`CONDITION_RULES`, in the order the status lists them; ``Ready``, last, sums them up: :func:`ready`) or the
events of its reason (:data:`EVENT_RULES`, in the order they are posted). To add a condition or an event: a function
here, a row in its table and a test (tests/operator/test_status_rules.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge_agent.core import Problem, Role, TransferPlan
from kvbridge_agent.core.parallel import ranks_words
from kvbridge_operator.api.names import PODS_ANNOTATION
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.api.status import Advisory, Condition, ConditionType, Endpoint, RoleStatus, ServingEndpoint
from kvbridge_operator.controller.actions import Event

#: the reason of the Warning event that states the spec's advisories (status.advisories)
ADVISORY = "Advisory"
#: the longest message of a condition or event kvbridge writes (a condition's may hold 32,768 characters): a spec
#: with thousands of problems (a template of thousands of odd items) is summed up, not refused for its message
MAX_MESSAGE = 8192
_MORE = "; and {count} more problem(s) (kvbridge plan lists them all)"


def bounded(message: str) -> str:
    """``message``, cut to :data:`MAX_MESSAGE` characters (saying how long it was) when longer."""
    if len(message) <= MAX_MESSAGE:
        return message
    cut = f"... ({len(message)} characters)"
    return message[: MAX_MESSAGE - len(cut)] + cut


def problems_message(problems: Sequence[Problem], fix: str) -> str:
    """Every problem as far as :data:`MAX_MESSAGE` goes, then the checked fix for all of them at once (when the
    search finds one)."""
    fixed = f". A fix that passes every check: {fix}" if fix else ""
    parts = [f"{p.code} at {p.field}: {p.message}" for p in problems]
    room = MAX_MESSAGE - len(fixed) - len(_MORE.format(count=len(parts)))
    kept: list[str] = []
    length = -2  # the separators: one fewer than the parts
    for part in parts:
        length += len(part) + 2
        if length > room:
            break
        kept.append(part)
    more = _MORE.format(count=len(parts) - len(kept)) if len(kept) < len(parts) else ""
    return bounded("; ".join(kept) + more + fixed)


@dataclass(frozen=True)
class Seen:
    """What the rules read: the spec and its verdict, what runs (counted by observe.py) and the status as read."""

    spec: DisaggregatedDeploymentSpec
    verdict: TransferPlan | Sequence[Problem]
    generation: int
    previous: Obj  # the status as read (maybe empty)
    annotations: dict[str, str]  # the deployment's, as read
    fix: str  # an incompatible spec's checked fix, "" when none
    roles: dict[Role, RoleStatus]  # each role's counts
    created: dict[Role, bool]  # whether each role's workload exists
    endpoints: list[Endpoint]  # the ready prefill engines'
    advisories: list[Advisory]
    incarnations: dict[str, str]  # each prefill engine's pod uid and restarts, by name
    decode_endpoints: Sequence[ServingEndpoint] = ()  # the ready decode engines'
    #: the (prefill, decode) pairing keys checked compatible besides equal ones (status.rollout.pairings)
    pairings: frozenset[tuple[str, str]] = frozenset()

    def pair(self, prefill: str, decode: str) -> bool:
        """Whether pods of these pairing keys pair, as routers pair them: equal keys, or a pair listed."""
        return prefill == decode or (prefill, decode) in self.pairings

    @property
    def old_conditions(self) -> list[Obj]:
        return list(self.previous.get("conditions") or [])


# -- conditions ------------------------------------------------------------------------------------------------------


def compatible(seen: Seen) -> Condition:
    """Compatible: the plan in words, or every problem and the checked fix."""
    verdict, spec = seen.verdict, seen.spec
    if isinstance(verdict, TransferPlan):
        plan_text = (
            f"prefill {ranks_words(spec.prefill)} -> decode {ranks_words(spec.decode)}, "
            f"{verdict.wire.block_size}-token {verdict.wire.layout.value} wire blocks, "
            f"{len(verdict.for_decode_rank(0).reads)} read(s) per decode rank"
        )
        return _condition(seen, ConditionType.COMPATIBLE, "True", "PlanBuilt", plan_text)
    return _condition(seen, ConditionType.COMPATIBLE, "False", "Incompatible", problems_message(verdict, seen.fix))


def prefill_ready(seen: Seen) -> Condition:
    """PrefillReady: every prefill engine the role runs is ready."""
    return _role_ready(seen, Role.PREFILL, ConditionType.PREFILL_READY)


def decode_ready(seen: Seen) -> Condition:
    """DecodeReady: every decode engine the role runs is ready."""
    return _role_ready(seen, Role.DECODE, ConditionType.DECODE_READY)


def _role_ready(seen: Seen, role: Role, kind: ConditionType) -> Condition:
    if not seen.created[role]:
        return _condition(seen, kind, "False", "NotCreated", f"no {role.value} workload exists")
    counts = seen.roles[role]
    ok = counts.ready_replicas >= counts.replicas
    return _condition(
        seen,
        kind,
        "True" if ok else "False",
        "AllReplicasReady" if ok else "ReplicasNotReady",
        f"{counts.ready_replicas}/{counts.replicas} {role.value} pods ready",
    )


def available(seen: Seen) -> Condition:
    """Available: the deployment serves, whatever else is starting: a ready prefill pod (its side channel for decode's
    handshake, its HTTP port for routers) and a ready decode pod that a router pairs with it, by the rule routers
    follow (equal pairing keys, or a pair listed in status.rollout.pairings). As a Deployment's Available, it stays
    True while a scale-up's new pods start; it does not depend on Compatible (an incompatible update changes nothing
    that runs: the pods as they were still serve)."""
    kind = ConditionType.AVAILABLE
    prefill = [e for e in seen.endpoints if e.pairing]
    decode = [e for e in seen.decode_endpoints if e.pairing]
    counts = f"{seen.roles[Role.PREFILL].ready} prefill, {seen.roles[Role.DECODE].ready} decode pods ready"
    if not prefill or not decode:
        role = "prefill" if not prefill else "decode"
        reason = "NoPrefillReady" if not prefill else "NoDecodeReady"
        return _condition(seen, kind, "False", reason, f"no ready {role} pod to serve with ({counts})")
    paired = [(p.pod, d.pod) for p in prefill for d in decode if seen.pair(p.pairing, d.pairing)]
    if not paired:
        message = f"no ready prefill and decode pods of one pairing key or a pair in status.rollout.pairings ({counts})"
        return _condition(seen, kind, "False", "NoPairReady", message)
    serving = f"{len({p for p, _ in paired})} prefill and {len({d for _, d in paired})} decode pods in pairs"
    return _condition(seen, kind, "True", "MinimumReplicasAvailable", f"serving: {serving} ({counts})")


def ready(seen: Seen, conditions: Sequence[Condition]) -> Condition:
    """Ready: the first of the other conditions that is not True, else serving with every replica; while the
    deployment is Available (a scale-up's new pods starting, say) the message says the ready pods serve."""
    failing = [c for c in conditions if c.status != "True"]
    if failing:
        first = failing[0]
        serving = first.type is not ConditionType.AVAILABLE and any(
            c.type is ConditionType.AVAILABLE and c.status == "True" for c in conditions
        )
        return _condition(
            seen,
            ConditionType.READY,
            "False",
            first.reason,
            # "Compatible: PREFILL_HEADS_REPLICATED ..." read as compatible: say which condition is not True
            f"{first.type.value} is {first.status}: {first.message}"
            + ("; the ready pods serve meanwhile (Available is True)" if serving else ""),
        )
    return _condition(seen, ConditionType.READY, "True", "Ready", "prefill and decode are serving, every replica ready")


def _condition(seen: Seen, kind: ConditionType, status: str, reason: str, message: str) -> Condition:
    return Condition(type=kind, status=status, reason=reason, message=message, observed_generation=seen.generation)


# -- events ----------------------------------------------------------------------------------------------------------


def incompatible(seen: Seen) -> list[Event]:
    """An incompatible spec: said once per generation."""
    if isinstance(seen.verdict, TransferPlan):
        return []
    was = {str(c.get("type")): c for c in seen.old_conditions}.get("Compatible", {})
    if was.get("status") == "False" and int(was.get("observedGeneration", -1)) == seen.generation:
        return []
    return [Event("Warning", "Incompatible", problems_message(list(seen.verdict), seen.fix))]


def advised(seen: Seen) -> list[Event]:
    """What runs other than the spec asks: said once per generation (and when it changes), never silently."""
    if not seen.advisories or (
        seen.previous.get("advisories") == [a.model_dump(by_alias=True, mode="json") for a in seen.advisories]
        and int(seen.previous.get("observedGeneration", -1)) == seen.generation
    ):
        return []
    return [Event("Warning", ADVISORY, "; ".join(f"{a.code} at {a.field}: {a.message}" for a in seen.advisories))]


def endpoints_changed(seen: Seen) -> list[Event]:
    """The ready prefill engines' addresses changed (decode agents and routers follow them)."""
    old = [Endpoint.model_validate(e) for e in (seen.previous.get("prefill") or {}).get("endpoints") or []]
    if old == seen.endpoints or not (old or seen.endpoints):
        return []
    listed = ", ".join(f"{e.pod}={e.ip}:{e.port}" for e in seen.endpoints) or "none"
    return [Event("Normal", "EndpointsChanged", f"prefill endpoints: {listed}")]


def prefill_restarted(seen: Seen) -> list[Event]:
    """A prefill pod seen before (the deployment's annotation remembers each one's incarnation) restarted."""
    before = load_incarnations(seen.annotations.get(PODS_ANNOTATION))
    return [
        Event(
            "Normal",
            "PrefillRestarted",
            f"prefill pod {name} restarted; decode agents re-handshake with its new incarnation",
        )
        for name, incarnation in sorted(seen.incarnations.items())
        if name in before and before[name] != incarnation
    ]


def rollout_progress(seen: Seen) -> list[Event]:
    """A role's count of pods on the current revision moved (or a rollout began)."""
    found = []
    for role in Role:
        old = (seen.previous.get(role.value) or {}).get("updatedReplicas")
        now = seen.roles[role]
        if (
            now.updated_replicas != old
            and seen.created[role]
            and (now.updated_replicas < now.replicas or old is not None)
        ):
            found.append(
                Event(
                    "Normal",
                    "RolloutProgress",
                    f"{role.value}: {now.updated_replicas}/{now.replicas} pods on the current "
                    f"revision, {now.ready_replicas} ready",
                )
            )
    return found


def load_incarnations(text: str | None) -> dict[str, str]:
    """The prefill pods' incarnations the deployment's annotation remembers (none when it is unreadable)."""
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


# -- the tables ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConditionRule:
    type: ConditionType
    observe: Callable[[Seen], Condition]


@dataclass(frozen=True)
class EventRule:
    reason: str
    observe: Callable[[Seen], list[Event]]


#: the conditions, in the status's order (Ready follows them: :func:`ready`)
CONDITION_RULES: tuple[ConditionRule, ...] = (
    ConditionRule(ConditionType.COMPATIBLE, compatible),
    ConditionRule(ConditionType.PREFILL_READY, prefill_ready),
    ConditionRule(ConditionType.DECODE_READY, decode_ready),
    ConditionRule(ConditionType.AVAILABLE, available),
)
#: the events, in the order they are posted
EVENT_RULES: tuple[EventRule, ...] = (
    EventRule("Incompatible", incompatible),
    EventRule(ADVISORY, advised),
    EventRule("EndpointsChanged", endpoints_changed),
    EventRule("PrefillRestarted", prefill_restarted),
    EventRule("RolloutProgress", rollout_progress),
)


def conditions(seen: Seen) -> list[Condition]:
    """Every condition, Ready last."""
    found = [rule.observe(seen) for rule in CONDITION_RULES]
    return [*found, ready(seen, found)]


def events(seen: Seen) -> list[Event]:
    """Every event the status calls for, in order."""
    return [event for rule in EVENT_RULES for event in rule.observe(seen)]
