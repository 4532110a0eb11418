"""Plan = start, for every zoo member: ``kvbridge plan``'s check over the grid (grid.py: TP 1/2/4/8 each side where
the heads spread evenly, blocks 16/32/64 each side, every layout the spec reaches, both connectors, GPUs), and for
the points it calls compatible with kvbridge's connector, the connector started on vLLM's own cache of the model
(vllm_caches.py: vLLM's ``get_kv_cache_groups`` -> ``get_kv_cache_config_from_groups`` -> ``allocate_kv_cache``,
registered with real NIXL): nothing plan calls compatible is refused at start, and what start would refuse plan
refuses before scheduling, with the code and field.

The verdicts cover the whole grid (about 72,000 points). The starts cover, per member, every (role, TP size, block
size, rendered layout, cache kind) that some compatible point has, each once (greedily, with a TP rank that varies
from point to point), both roles of each chosen point: starting every compatible point would repeat the same few
registrations thousands of times.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import CacheKind, KVBridgeError, KVLayout, Role, RoleSettings
from kvbridge_agent.core.layout import rendered_order
from kvbridge_agent.vllm_connector import worker as worker_module
from kvbridge_operator.api.spec import Connector
from kvbridge_operator.children.engines import vllm_models

from .grid import Point, at, deployment, points, verdict_codes
from .vllm_caches import SharedAgent, kv_cache_config, scaled, start
from .zoo import ZOO, Member

pytestmark = pytest.mark.vllm

#: what the whole grid gives with each connector: (compatible points, points refused), and refusals by code
TOTALS = {Connector.KVBRIDGE: (13472, 21520), Connector.NIXL: (8990, 26002)}


@functools.cache
def verdicts(folder: str) -> tuple[tuple[Point, tuple[str, ...]], ...]:
    member = next(m for m in ZOO if m.folder == folder)
    base = deployment(member.model())
    return tuple((point, tuple(verdict_codes(at(base, point)))) for point in points(member.model()))


def test_the_grid_says_compatible_or_refuses_with_a_code() -> None:
    """Every point of every member: compatible, or refused with codes; kvbridge's own refusals only with its
    connector, every point of a model it cannot move refused with that model's code; the totals of docs/vllm.md."""
    totals: Counter[tuple[Connector, bool]] = Counter()
    for member in ZOO:
        for point, codes in verdicts(member.folder):
            totals[point.connector, not codes] += 1
            own = {code for code in codes if code.startswith("VLLM_KVBRIDGE_") or code == "LAYOUT_UNSUPPORTED"}
            if point.connector is Connector.NIXL:
                assert not own, (member.folder, point.words, codes)
            elif member.refused:
                assert member.refused in codes, (member.folder, point.words, codes)
    assert {c: (totals[c, True], totals[c, False]) for c in Connector} == TOTALS


#: what a start of one role depends on, coarse (the default stage) or fine (with the block size: the slow stage)
Key = tuple[object, ...]


def _key(point: Point, role: Role, blocks: bool) -> Key:
    own = point.prefill if role is Role.PREFILL else point.decode
    layout = rendered_order(own.kv_layout, point.cache_kind).name
    key: Key = (role, own.tensor_parallel_size, layout, point.cache_kind)
    return (*key, own.block_size) if blocks else key


def covering(member: Member, blocks: bool) -> list[Point]:
    """Compatible points with kvbridge's connector whose start keys cover every compatible point's: greedily, the
    point with the most keys not yet covered first."""
    candidates = [
        point for point, codes in verdicts(member.folder) if not codes and point.connector is Connector.KVBRIDGE
    ]
    keys = {id(point): {_key(point, role, blocks) for role in Role} for point in candidates}
    seen: set[Key] = set()
    chosen: list[Point] = []
    while candidates:
        best = max(candidates, key=lambda point: len(keys[id(point)] - seen))
        if not keys[id(best)] - seen:
            break
        chosen.append(best)
        seen |= keys[id(best)]
    return chosen


def start_each(member: Member, chosen: list[Point]) -> None:
    """Start both roles of each point (a TP rank that varies from point to point); fail naming what was refused."""
    model = member.model()
    for index, point in enumerate(chosen):
        for role, own in ((Role.PREFILL, point.prefill), (Role.DECODE, point.decode)):
            rank = index % own.tensor_parallel_size
            try:
                started = start(model, role, point.prefill, point.decode, rank)
            except KVBridgeError as exc:
                pytest.fail(f"{member.folder} {point.words}: {role.value} rank {rank} refused: {exc.code} {exc}")
            started.shutdown()


@pytest.fixture
def shared_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "Transport", SharedAgent)


@pytest.mark.usefixtures("shared_agent")
@pytest.mark.parametrize("member", [m for m in ZOO if not m.refused], ids=lambda m: m.folder)
def test_nothing_plan_calls_compatible_is_refused_at_start(member: Member) -> None:
    """Every (role, TP size, rendered layout, cache kind) of a compatible point, started once."""
    chosen = covering(member, blocks=False)
    assert chosen
    start_each(member, chosen)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_agent")
@pytest.mark.parametrize("member", [m for m in ZOO if not m.refused], ids=lambda m: m.folder)
def test_nothing_plan_calls_compatible_is_refused_at_start_at_any_block_size(member: Member) -> None:
    """Every (role, TP size, block size, rendered layout, cache kind) of a compatible point, started once."""
    start_each(member, covering(member, blocks=True))


@pytest.mark.parametrize("member", [m for m in ZOO if m.state is None], ids=lambda m: m.folder)
def test_plan_knows_how_vllm_groups_each_model(member: Member) -> None:
    """The groups plan reasons about (vllm_models.vllm_groups: kinds, layers per group, padding) are the ones vLLM's
    ``get_kv_cache_groups`` makes of the model's layers."""
    model = scaled(member.model())
    config = kv_cache_config(model, 16, 1, KVCacheLayout.LBHNC)
    assert [len(group.layer_names) for group in config.kv_cache_groups] == [
        layers for _kind, layers in vllm_models.vllm_groups(model)
    ]


def test_gemma3_27b_padded_and_cross_layer_is_refused_by_plan_and_at_start() -> None:
    """Gemma-3-27B: vLLM pads its groups (52 sliding, 10 full: groups of 10, the sliding ones 9 and 8), and with
    cacheKind CrossLayer and 16 KV heads a rank holds several heads: plan refuses it (LAYOUT_UNSUPPORTED at
    spec.model.cacheKind, fix Split), as the connector's start does; with Split it starts."""
    member = next(m for m in ZOO if m.folder == "gemma-3-27b")
    model = member.model()
    assert vllm_models.padded(model)
    role = RoleSettings(tensor_parallel_size=2, block_size=16, kv_layout=KVLayout.HND)
    point = Point(Connector.KVBRIDGE, CacheKind.CROSS_LAYER, role, role)
    codes = verdict_codes(at(deployment(model), point))
    assert codes == ["LAYOUT_UNSUPPORTED"]
    cross = model.model_copy(update={"cache_kind": CacheKind.CROSS_LAYER})
    with pytest.raises(KVBridgeError) as refused:
        start(cross, Role.DECODE, role, role)
    assert refused.value.code == "LAYOUT_UNSUPPORTED"
    start(model, Role.DECODE, role, role).shutdown()


def test_chunked_local_attention_is_refused_by_plan_as_at_start() -> None:
    """Llama-4-Scout on GPUs: vLLM keeps its chunked local layers in groups of their own, which the connector's start
    refuses (CONNECTOR_UNSUPPORTED); plan refuses it first, at spec.model.layerTypes, advising NixlConnector."""
    model = next(m for m in ZOO if m.folder == "llama-4-scout").model()
    role = RoleSettings(tensor_parallel_size=1, block_size=16)
    with pytest.raises(KVBridgeError) as refused:
        start(model, Role.DECODE, role, role)
    assert refused.value.code == "CONNECTOR_UNSUPPORTED"
    point = Point(Connector.KVBRIDGE, CacheKind.SPLIT, role, role)
    assert verdict_codes(at(deployment(model), point)) == ["VLLM_KVBRIDGE_CHUNKED_ATTENTION"]
    assert verdict_codes(at(deployment(model), Point(Connector.NIXL, CacheKind.SPLIT, role, role))) == []
