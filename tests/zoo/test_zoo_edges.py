"""Every zoo family ``kvbridge plan`` accepts with kvbridge's connector, moved byte-exact on vLLM's allocator with
prompt lengths drawn by hypothesis over every block and window edge; every family it refuses, refused with its code.

Per family (:data:`SETUPS`), at one point of the plan's grid that ``kvbridge plan`` calls compatible (TP 1 to 1, the
block size and each side's layout in the table; block sizes and layouts rotate over the families so that 16, 32 and
64-token blocks and the three layouts a spec reaches, LBHNC, LBNHC and BHLNC, are each moved): vLLM 0.32's own cache
of the family's layer pattern (its ``get_kv_cache_groups``, padded groups included, ``allocate_kv_cache``), block
tables from vLLM's ``KVCacheManager`` (prefix caching on: prompts of one prompt family hit each other's blocks on
both sides), both connector halves with real NIXL and verification ``All`` (tests/agent/vllm_connector/
vllm_engines.py). Each length must move byte-exact where decode's vLLM reads it (``check_bytes``), leave no null
block inside any sliding window decode's first forward reaches (``window_gaps``), and offer the whole prompt, or all
but its last token exactly at a window edge (window_backoff.py).

Lengths (:func:`lengths`): ``k * block + d`` and ``m * window + j * block + d`` (``d`` in -1, 0, 1), the edge where vLLM
frees a sliding group's first block (``(n - window + 1) % block == 0``, and one either side), lengths under one block,
and any length up to two windows and three blocks (twelve blocks without a window), with explicit examples at
1, block - 1, block, block + 1 and, with a window, window - 1, window, window + 1 and window + block - 1 (± 1).

Families: dense and GQA (Llama-3.1-8B, -70B, Qwen3-8B, -32B, Mistral-Small-3.1-24B, Phi-4), MoE (Qwen3-30B-A3B,
-235B-A22B, GLM-4.5: experts hold no KV), MLA (DeepSeek-V3, Kimi-K2: 64-token blocks, the only ones plan accepts),
sliding windows with sinks (gpt-oss-20b, -120b: the sinks are per-head weights, no KV), hybrid groups (Gemma-3-12B:
6 of 8; Gemma-3-1B and -27B: padded, 7 groups). Refused before scheduling, at every setup's point: Llama-4-Scout
(chunked local attention, ``VLLM_KVBRIDGE_CHUNKED_ATTENTION``: no chunk edges to draw), Mistral-7B-v0.1
(``VLLM_KVBRIDGE_SLIDING_ONLY``), Qwen3-Next-80B-A3B, Nemotron-Nano-9B-v2 and Falcon-H1-1.5B
(``VLLM_KVBRIDGE_STATE_SPACE``).

Scaled down: 2 KV heads of 16 elements (MLA, and Gemma-3-1B's one KV head: one of 16); the layer pattern, windows
and block size are the family's point's. Each family's engines are built once (a module-scoped fixture) and serve
all its examples (freed blocks stay in the prefix caches); the file takes about 30 s on one core (26 s of CPU, 11 s
of it importing vLLM).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import CacheKind, KVLayout, Role, RoleSettings
from kvbridge_agent.core.layout import rendered_order
from kvbridge_agent.core.model import LayerType
from kvbridge_agent.vllm_connector.window_backoff import at_window_edge, sliding_windows
from kvbridge_operator.api.spec import Connector
from tests.agent.vllm_connector.vllm_engines import Engine, Model, check_bytes, move, window_gaps

from .grid import Point, at, deployment, verdict_codes
from .zoo import ZOO, Member

pytestmark = pytest.mark.vllm

HND, NHD = KVLayout.HND, KVLayout.NHD
SPLIT, CROSS = CacheKind.SPLIT, CacheKind.CROSS_LAYER


@dataclass(frozen=True)
class Setup:
    """A point of the plan's grid for one family: the block size, the cache kind and each side's ``kvLayout``, and
    how many lengths hypothesis draws beside the explicit edges."""

    block: int
    kind: CacheKind
    prefill: KVLayout
    decode: KVLayout
    examples: int

    def point(self) -> Point:
        prefill = RoleSettings(block_size=self.block, kv_layout=self.prefill)
        decode = RoleSettings(block_size=self.block, kv_layout=self.decode)
        return Point(Connector.KVBRIDGE, self.kind, prefill, decode)

    def layout(self, role: Role) -> KVCacheLayout:
        """The layout kvbridge renders for ``role`` (``VLLM_KV_CACHE_LAYOUT``)."""
        return KVCacheLayout[rendered_order(self.prefill if role is Role.PREFILL else self.decode, self.kind).name]


#: the families plan accepts with kvbridge's connector, each at a point it calls compatible
SETUPS = {
    "llama-3.1-8b": Setup(16, SPLIT, HND, NHD, 6),
    "llama-3.1-70b": Setup(32, CROSS, HND, HND, 6),
    "qwen3-8b": Setup(64, SPLIT, NHD, HND, 6),
    "qwen3-32b": Setup(16, CROSS, HND, HND, 6),
    "qwen3-30b-a3b": Setup(32, SPLIT, HND, NHD, 6),
    "qwen3-235b-a22b": Setup(64, SPLIT, NHD, HND, 6),
    "deepseek-v3": Setup(64, SPLIT, HND, NHD, 6),
    "kimi-k2": Setup(64, SPLIT, NHD, HND, 6),
    "gpt-oss-20b": Setup(16, SPLIT, HND, NHD, 12),
    "gpt-oss-120b": Setup(32, CROSS, HND, HND, 12),
    "gemma-3-1b": Setup(16, CROSS, HND, HND, 10),
    "gemma-3-12b": Setup(32, SPLIT, NHD, HND, 10),
    "gemma-3-27b": Setup(64, SPLIT, HND, NHD, 10),
    "mistral-small-3.1-24b": Setup(64, CROSS, HND, HND, 6),
    "phi-4": Setup(16, SPLIT, NHD, HND, 6),
    "glm-4.5": Setup(32, SPLIT, HND, NHD, 6),
}
MEMBERS = {member.folder: member for member in ZOO}


def test_every_family_is_moved_here_or_refused_with_its_code() -> None:
    """Plan calls each family's point compatible, and refuses each other family at every one of those points with
    the family's code: no family of the zoo is silently left out."""
    assert set(SETUPS) == {member.folder for member in ZOO if not member.refused}
    for folder, setup in SETUPS.items():
        assert verdict_codes(at(deployment(MEMBERS[folder].model()), setup.point())) == [], folder
    refused = [member for member in ZOO if member.refused]
    assert {member.refused for member in refused} == {
        "VLLM_KVBRIDGE_CHUNKED_ATTENTION",
        "VLLM_KVBRIDGE_SLIDING_ONLY",
        "VLLM_KVBRIDGE_STATE_SPACE",
    }
    for member, setup in itertools.product(refused, SETUPS.values()):
        codes = verdict_codes(at(deployment(member.model()), setup.point()))
        assert member.refused in codes, (member.folder, setup.point().words, codes)


def windows_of(member: Member) -> list[int]:
    model = member.model()
    return [model.sliding_window] if LayerType.SLIDING in model.layer_kinds else []


def longest(block: int, windows: list[int]) -> int:
    """The longest prompt drawn: two windows and three blocks, or twelve blocks without a window."""
    return max([12 * block, *(2 * window + 3 * block for window in windows)])


def lengths(block: int, windows: list[int]) -> st.SearchStrategy[int]:
    """Prompt lengths at and around every block and window edge, short ones and any up to :func:`longest`."""
    cap = longest(block, windows)
    d = st.integers(-1, 1)
    edges = [
        st.builds(lambda k, d: k * block + d, st.integers(0, cap // block), d),
        st.integers(1, block - 1),
        st.integers(1, cap),
    ]
    for window in windows:
        multiples = st.builds(lambda m, j, d, w=window: m * w + j * block + d, st.integers(1, 2), st.integers(-2, 2), d)
        # where vLLM frees a block of the window: (n - window + 1) % block == 0
        freeing = st.builds(lambda k, d, w=window: w - 1 + k * block + d, st.integers(1, (cap - window) // block), d)
        edges += [multiples, freeing]
    return st.one_of(edges).map(lambda n: min(cap, max(1, n)))


def explicit(block: int, windows: list[int]) -> list[int]:
    """The edges every family is moved at, whatever hypothesis draws."""
    found = [1, block - 1, block, block + 1]
    for window in windows:
        found += [window - 1, window, window + 1, window + block - 2, window + block - 1, window + block]
    return sorted(set(found))


@dataclass
class Pair:
    folder: str
    setup: Setup
    prefill: Engine
    decode: Engine


@contextlib.contextmanager
def opened(folder: str, setup: Setup) -> Iterator[Pair]:
    """The family's prefill and decode engines at ``setup``, registered and introduced."""
    model = MEMBERS[folder].model()
    windows = tuple(model.sliding_window if kind is LayerType.SLIDING else None for kind in model.layer_kinds)
    # room for the longest prompt in each group (one without a window, at most 8 with) and a few blocks more
    windowed = windows_of(MEMBERS[folder])
    blocks = (8 if windowed else 1) * (longest(setup.block, windowed) // setup.block + 4)
    heads = 1 if model.is_mla else min(2, model.num_kv_heads)  # one KV head stays one (BHLNC: Gemma-3-1B)
    scaled = Model(
        windows, block=setup.block, heads=heads, head_size=16, num_blocks=blocks, mla=model.is_mla, spec=model
    )
    prefill = Engine(scaled, Role.PREFILL, setup.layout(Role.PREFILL))
    decode = Engine(scaled, Role.DECODE, setup.layout(Role.DECODE))
    try:
        for engine in (prefill, decode):
            engine.register()
        handshake = prefill.worker.get_handshake_metadata()
        assert handshake is not None
        prefill.scheduler.set_xfer_handshake_metadata({0: handshake})
        yield Pair(folder, setup, prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.fixture(scope="module", params=sorted(SETUPS), ids=sorted(SETUPS))
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """The family's engines, built once for all its examples."""
    with opened(request.param, SETUPS[request.param]) as engines:
        yield engines


COUNTER = itertools.count()


def check_move(pair: Pair, length: int, family: int) -> None:
    """One prompt of ``length`` tokens (of prompt family ``family``) moved: byte-exact, no null block in a window,
    the whole prompt offered but at a window edge."""
    prefill, decode = pair.prefill, pair.decode
    tokens = [family * 100_000 + (17 * i + family) % 9973 for i in range(length)]
    moved = move(prefill, decode, f"{pair.folder}-{next(COUNTER)}", tokens)
    assert moved.ok, (pair.folder, length, moved.failures, moved.load_errors)
    check_bytes(decode, moved)
    assert not window_gaps(decode, moved), (pair.folder, length, window_gaps(decode, moved))
    block = pair.setup.block
    edge = at_window_edge(length, sliding_windows(decode.scheduler.settings), (block, block))
    assert len(moved.tokens) == (length - 1 if edge else length), (pair.folder, length)
    groups = decode.scheduler.settings.groups
    if groups is not None:  # decode read each group's blocks its table holds, none of vLLM's null blocks
        offered = len(moved.tokens)
        held = [len([b for b in ids[: -(-offered // block)] if b]) for ids in moved.decode_table]
        assert moved.params["remoteGroupSizes"] == held == groups.sizes(offered), (pair.folder, length)


def every_edge(pair: Pair, examples: int) -> None:
    """:func:`check_move` at the explicit edges and at ``examples`` lengths hypothesis draws."""
    block, windows = pair.setup.block, windows_of(MEMBERS[pair.folder])

    def one(length: int, family: int) -> None:
        check_move(pair, length, family)

    run = given(length=lengths(block, windows), family=st.integers(0, 2))(one)
    for length in explicit(block, windows):
        run = example(length=length, family=0)(run)
    limits = settings(
        max_examples=examples,
        deadline=None,
        print_blob=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    limits(run)()


def test_a_family_moves_byte_exact_at_every_edge(pair: Pair) -> None:
    every_edge(pair, pair.setup.examples)
