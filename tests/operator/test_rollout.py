"""The rollout's steps against a simulated StatefulSet controller and kubelet (pure, fast, Hypothesis), and the
strategy each kind of spec change gets."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import Role
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.controller import revisions
from kvbridge_operator.controller.rollout import Phase, PodState, RoleTarget, Strategy, step
from kvbridge_sim.support import until

from .test_operator import example


@dataclass
class Pod:
    ordinal: int
    key: str
    revision: str
    age: int = 0  # ticks since created: ready from the second tick on

    @property
    def ready(self) -> bool:
        return self.age >= 1


@dataclass
class StatefulSet:
    """What the StatefulSet controller does (Parallel pod management, RollingUpdate with a partition): create
    every missing ordinal below replicas, delete those at or above it, and replace one pod at a time, highest
    ordinal first, among ordinals at or above the partition whose revision is not the template's, once every
    other pod is ready."""

    replicas: int
    partition: int
    key: str
    revision: str
    pods: dict[int, Pod] = field(default_factory=dict)

    def tick(self) -> None:
        for pod in self.pods.values():
            pod.age += 1
        for ordinal in [o for o in self.pods if o >= self.replicas]:
            del self.pods[ordinal]
        for ordinal in range(self.replicas):
            if ordinal not in self.pods:
                self.pods[ordinal] = Pod(ordinal, self.key, self.revision)
        stale = sorted(
            (o for o, p in self.pods.items() if o >= self.partition and p.revision != self.revision), reverse=True
        )
        if stale and all(p.ready for o, p in self.pods.items() if o != stale[0]):
            self.pods[stale[0]] = Pod(stale[0], self.key, self.revision)


def run(
    counts: dict[Role, int],
    compatible: set[tuple[str, str]],
    surge: int = 1,
    unavailable: int = 0,
    ticks: int = 400,
) -> list[Phase]:
    """Start with every pod on the old spec (pairing key K0), roll to the new one (K1), which changes both roles'
    templates; ``compatible`` holds the mixed pairs (prefill key, decode key) that pair. Check the invariant at
    every tick; return the phases seen."""
    old = dict.fromkeys(Role, "K0")
    new = dict.fromkeys(Role, "K1")
    sets = {role: StatefulSet(counts[role], 0, old[role], old[role]) for role in Role}
    for _ in range(3):
        for sts in sets.values():
            sts.tick()

    def judge(p: str, d: str) -> str | None:
        return None if (p, d) in compatible or p == d else "incompatible"

    phases: list[Phase] = []
    new_key = "K1"
    for _ in range(ticks):
        states = {
            role: [
                PodState(p.ordinal, p.revision == new[role], p.ready, _pair(p.key, role))
                for p in sets[role].pods.values()
            ]
            for role in Role
        }
        targets = {
            role: RoleTarget(
                counts[role], surge, unavailable, sets[role].partition if sets[role].revision == new[role] else None
            )
            for role in Role
        }
        result = step(targets, states, new_key, lambda p, d: judge(p, d))
        if not phases or phases[-1] is not result.phase:
            phases.append(result.phase)
        for role in Role:
            sets[role].revision, sets[role].key = new[role], new[role]
            sets[role].replicas, sets[role].partition = result.replicas[role], result.partition[role]
        for sts in sets.values():
            sts.tick()
            _check(sets, counts, compatible, unavailable if result.strategy is Strategy.IN_PLACE else None)
        if result.phase is Phase.COMPLETE:
            break
    assert phases[-1] is Phase.COMPLETE, phases
    assert all(p.revision == new[role] for role in Role for p in sets[role].pods.values())
    assert {role: len(sets[role].pods) for role in Role} == counts
    return phases


def _pair(key: str, role: Role) -> str:
    return key  # a pod's pairing key is its role's key in this simulation


def _check(
    sets: dict[Role, StatefulSet], counts: dict[Role, int], compatible: set[tuple[str, str]], floor: int | None
) -> None:
    ready = {role: [p for p in sets[role].pods.values() if p.ready] for role in Role}
    deployment_ready = all(len(ready[role]) >= counts[role] for role in Role)
    if deployment_ready:
        for decode in ready[Role.DECODE]:
            assert any((p.key, decode.key) in compatible or p.key == decode.key for p in ready[Role.PREFILL]), (
                f"ready decode pod {decode} has no compatible ready prefill pod"
            )
    if floor is not None:  # in place: a role never has fewer ready pods than its count minus maxUnavailable
        for role in Role:
            assert len(ready[role]) >= counts[role] - floor, f"{role.value}: {len(ready[role])} ready"


MIXED = {("K0", "K1"), ("K1", "K0")}


def test_a_compatible_change_rolls_in_place_prefill_then_decode() -> None:
    phases = run({Role.PREFILL: 2, Role.DECODE: 3}, MIXED)
    assert phases == [Phase.ROLLING_PREFILL, Phase.ROLLING_DECODE, Phase.SCALING_IN, Phase.COMPLETE]


def test_an_incompatible_change_goes_blue_green_and_never_strands_a_decode_pod() -> None:
    phases = run({Role.PREFILL: 2, Role.DECODE: 2}, set())
    assert phases == [
        Phase.SURGING_PREFILL,
        Phase.SURGING_DECODE,
        Phase.RETIRING_DECODE,
        Phase.RETIRING_PREFILL,
        Phase.SCALING_IN,
        Phase.COMPLETE,
    ]


@settings(max_examples=60, deadline=None)
@given(
    prefill=st.integers(1, 4),
    decode=st.integers(1, 4),
    surge=st.integers(0, 2),
    unavailable=st.integers(0, 2),
    compatible=st.sets(st.sampled_from(sorted(MIXED))),
)
def test_every_rollout_completes_and_keeps_every_ready_decode_pod_paired(
    prefill: int, decode: int, surge: int, unavailable: int, compatible: set[tuple[str, str]]
) -> None:
    if surge + unavailable == 0:
        surge = 1
    run({Role.PREFILL: prefill, Role.DECODE: decode}, compatible, surge, unavailable)


def test_in_place_with_surge_never_lets_a_role_drop_below_its_count() -> None:
    run({Role.PREFILL: 1, Role.DECODE: 1}, MIXED, surge=1, unavailable=0)  # _check asserts the floor every tick


# -- the decision for real specs --------------------------------------------------------------------------------------
def _records(*documents: dict) -> tuple[dict[str, dict], list[str]]:  # type: ignore[type-arg]
    records, keys = {}, []
    for document in documents:
        dd = parse_deployment(document)
        keys.append(pairing(dd.spec))
        records[keys[-1]] = revisions.record(dd)
    return records, keys


def changed(**spec: dict) -> dict:  # type: ignore[type-arg]
    document = example("synthetic/llama3-8b-hetero-tp")
    for section, values in spec.items():
        document["spec"].setdefault(section, {}).update(values)
    return document


def strategy_for(before: dict, after: dict) -> tuple[Strategy, str]:  # type: ignore[type-arg]
    records, (old, new) = _records(before, after)
    judge = revisions.pairs_with(records, "llama3-8b")
    targets = {role: RoleTarget(2) for role in Role}
    pods = {role: [PodState(0, False, True, old), PodState(1, False, True, old)] for role in Role}
    result = step(targets, pods, new, judge)
    return result.strategy, result.reason


def test_which_changes_roll_in_place_and_which_go_blue_green() -> None:
    base = changed()
    assert strategy_for(base, changed(decode={"tensorParallelSize": 2}))[0] is Strategy.IN_PLACE
    assert strategy_for(base, changed(prefill={"tensorParallelSize": 4}))[0] is Strategy.IN_PLACE
    assert strategy_for(base, changed(decode={"replicas": 3}))[0] is Strategy.IN_PLACE  # same key
    dtype, why = strategy_for(base, changed(model={"kvCacheDtype": "fp8_e4m3"}))
    assert dtype is Strategy.BLUE_GREEN
    assert "spec.model differs" in why
    layout, why = strategy_for(base, changed(transfer={"conversion": "Off"}, decode={"kvLayout": "NHD"}))
    assert layout is Strategy.BLUE_GREEN


def test_pods_planned_with_other_wire_formats_are_not_paired() -> None:
    """Each running pod was planned with its own spec's peer settings: prefill 32 -> decode 16 is a compatible spec
    (prefill splits its blocks), but a prefill pod of the 32/32 spec offers 32-token wire blocks and a decode pod of
    the 16/16 spec reads 16-token ones. Found under load by benchmarks/chaos_under_load.py: the router paired them
    and decode refused every read (WIRE_FORMAT_MISMATCH)."""
    bigger = {"blockSize": 32}
    strategy, why = strategy_for(changed(), changed(prefill=bigger, decode=bigger))
    assert strategy is Strategy.BLUE_GREEN
    assert "WIRE_FORMAT_MISMATCH" in why


def test_an_unknown_key_is_never_paired_with_another() -> None:
    judge = revisions.pairs_with({}, "x")
    assert judge("a", "a") is None
    assert judge("a", "b") == "the spec of a is not known"


def _ready(pod: dict) -> bool:  # type: ignore[type-arg]
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)


# -- the real operator on the emulator, with a stand-in StatefulSet controller and kubelet -----------------------------
async def roll(change: dict, mixed_pairs: bool) -> tuple[list[str], list[dict]]:  # type: ignore[type-arg]
    """Create the example, let it become Ready, apply ``change``, and watch every instant until the rollout is
    complete: while the deployment is Ready, every ready decode pod has a ready prefill pod it pairs with."""
    import asyncio
    import contextlib

    from kvbridge_sim.cluster import StatefulSetController, cluster

    before = example("synthetic/llama3-8b-hetero-tp")
    after = changed(**change)
    (old_key, new_key) = (pairing(parse_deployment(before).spec), pairing(parse_deployment(after).spec))
    allowed = {(old_key, old_key), (new_key, new_key)}
    if mixed_pairs:
        allowed |= {(old_key, new_key), (new_key, old_key)}
    async with cluster() as c:
        stop = asyncio.Event()
        controller = asyncio.create_task(StatefulSetController(c).run(stop))
        ready_and_mixed = 0

        def check() -> None:
            nonlocal ready_and_mixed
            dd = c.deployment("llama3-8b")
            conditions = {x["type"]: x["status"] for x in (dd.get("status") or {}).get("conditions") or []}
            if conditions.get("Ready") != "True":
                return
            pods = [p for p in c.api.objects_of("pods") if _ready(p)]
            keyed = [
                (p["metadata"]["labels"]["kvbridge.io/role"], p["metadata"]["labels"]["kvbridge.io/pairing"])
                for p in pods
            ]
            prefill = {k for role, k in keyed if role == "prefill"}
            for role, key in keyed:
                if role == "decode":
                    assert any((p, key) in allowed for p in prefill), f"decode {key} stranded; prefill {prefill}"
            ready_and_mixed += len({k for _r, k in keyed}) > 1

        try:
            await c.apply(before)
            await c.wait(lambda: c.condition("llama3-8b", "Ready").get("status") == "True", what="Ready", timeout=30)
            await c.patch_spec("llama3-8b", after["spec"])

            def completed() -> bool:
                check()
                rollout = (c.deployment("llama3-8b").get("status") or {}).get("rollout") or {}
                return bool(rollout.get("revision") == new_key and rollout.get("phase") == "Complete")

            await until(
                completed,
                60,
                lambda: f"the rollout to complete: {c.deployment('llama3-8b').get('status')}",
                interval=0.005,
            )
            for _ in range(20):  # and it stays so
                check()
                await asyncio.sleep(0.01)
        finally:
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(controller, 5)
        assert ready_and_mixed > 0, "never saw old and new pods serve side by side while Ready"
        pods = c.api.objects_of("pods")
        assert sorted(p["metadata"]["name"] for p in pods) == [
            "llama3-8b-decode-0",
            "llama3-8b-prefill-0",
            "llama3-8b-prefill-1",
        ]
        assert {p["metadata"]["labels"]["kvbridge.io/pairing"] for p in pods} == {new_key}
        status = c.deployment("llama3-8b")["status"]
        return [e["reason"] + ": " + e["message"] for e in c.events("llama3-8b")], [status]


async def test_a_compatible_change_rolls_in_place_on_the_emulator() -> None:
    events, (status,) = await roll({"decode": {"tensorParallelSize": 2}}, mixed_pairs=True)
    started = [e for e in events if e.startswith("RolloutStarted")]
    assert started == ["RolloutStarted: InPlace: old and new pods of both roles are compatible"]
    phases = [e.split(":")[1].strip() for e in events if e.startswith("RolloutPhase")]
    assert phases == ["InPlace RollingPrefill", "InPlace RollingDecode", "InPlace ScalingIn"]
    assert any(e.startswith("RolloutComplete") for e in events)
    assert status["rollout"]["strategy"] == "InPlace"
    assert status["rollout"]["pairings"] == [{"prefill": status["pairing"], "decode": status["pairing"]}]


async def test_an_incompatible_change_goes_blue_green_on_the_emulator() -> None:
    events, (status,) = await roll({"model": {"kvCacheDtype": "fp8_e4m3"}}, mixed_pairs=False)
    started = [e for e in events if e.startswith("RolloutStarted")]
    assert len(started) == 1
    assert started[0].startswith("RolloutStarted: BlueGreen: prefill ")
    assert "spec.model differs" in started[0]
    phases = [e.split(":")[1].strip() for e in events if e.startswith("RolloutPhase")]
    assert phases == [
        "BlueGreen SurgingPrefill",
        "BlueGreen SurgingDecode",
        "BlueGreen RetiringDecode",
        "BlueGreen RetiringPrefill",
        "BlueGreen ScalingIn",
    ]
    assert status["rollout"]["phase"] == "Complete"
