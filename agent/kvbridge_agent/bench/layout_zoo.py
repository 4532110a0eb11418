"""``kvbridge-agent bench --layouts --zoo``: the layout cases on the KV geometries of the model zoo's families that
kvbridge's connector accepts (tests/zoo: their ``config.json``; ``kvbridge model`` turns each into ``spec.model``).

Each family's cache is what vLLM 0.32 allocates for one rank: its attention layers in one group, or, for a hybrid
(gpt-oss, Gemma-3), its KV cache groups overlaid in one allocation of the deepest group's layers (vLLM pads the
others), MLA's one latent per token and layer. A request moves what the connector moves: each group's blocks it
keeps (core.cache_groups: all of the prompt's for full attention, the window's for a sliding one), one flat list of
blocks of that allocation; so a case runs as the layouts bench's machinery runs a dense model of that many layers
(:func:`run_case`) with the request's blocks, ``request_blocks * block`` tokens of it. The cases: per-layer LBHNC
(``kvLayout: HND``, ``cacheKind: Split``), cross-layer BHLNC (``cacheKind: CrossLayer``) where the plan accepts it
(not MLA, not a padded hybrid with several KV heads a rank), and prefill TP 2 -> decode TP 1 on LBHNC where the KV
heads split. Requests are capped in tokens and in bytes a rank (:func:`prompt_tokens`), so a run stays short.

The table is declarative; tests/agent/bench/test_layout_zoo.py checks it against the zoo's ``config.json`` through
``kvbridge model`` and vLLM's own ``get_kv_cache_groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import ModelGeometry
from kvbridge_agent.core.cache_groups import CacheGroups

from .layout_cases import Case, cache_bytes, cases
from .layout_prefill import Allocate, Prefill

#: the block size of every zoo case (the grid's smallest; vLLM's GPU default)
BLOCK = 16
#: bytes a request moves on one decode rank at most, and prompt tokens at most (a whole ``--zoo`` run under a minute)
CAP_BYTES = 8 << 20
MOST_TOKENS = 1024


@dataclass(frozen=True)
class Family:
    """One zoo family's KV cache on a rank as vLLM allocates it: ``layers`` per block (every attention layer, or a
    hybrid's deepest KV cache group), ``kv_heads`` of ``head_dim`` (MLA: its one latent), and each group's sliding
    window (``None``: full attention)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = (None,)
    mla: bool = False
    #: ``cacheKind: CrossLayer`` (BHLNC) accepted: not for MLA, nor a padded hybrid with several KV heads a rank
    cross_layer: bool = True

    @property
    def model(self) -> ModelGeometry:
        return ModelGeometry(
            name=f"zoo-{self.name}",
            num_layers=self.layers,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            attention="MLA" if self.mla else "Dense",
        )

    def request_blocks(self, tokens: int, block: int = BLOCK) -> int:
        """Blocks a request of ``tokens`` prompt tokens moves: every group's it keeps."""
        return sum(CacheGroups.of(self.windows, block).sizes(tokens))

    def bytes_per_token(self, tokens: int, tp: int = 1) -> float:
        """Bytes a rank of ``tp`` reads per prompt token of a ``tokens``-token request (a window keeps fewer)."""
        return self.request_blocks(tokens) * BLOCK * self.block_bytes_per_token(tp) / tokens

    def block_bytes_per_token(self, tp: int = 1) -> int:
        """One token of one block on one rank: every layer slot of the allocation."""
        heads = 1 if self.mla else max(1, self.kv_heads // tp)
        return self.layers * heads * self.model.token_bytes_per_head

    def cases(self) -> list[Case]:
        names = ["LBHNC"]
        if self.cross_layer:
            names.append("BHLNC")
        if self.kv_heads >= 2 and not self.mla:
            names.append("LBHNC-tp2to1")
        return cases(names=names)

    def prompt_tokens(self, most: int = MOST_TOKENS, cap_bytes: int = CAP_BYTES) -> int:
        """The longest prompt, a multiple of the block up to ``most`` tokens, whose request moves at most
        ``cap_bytes`` on the decode rank (at least one block)."""
        per_block = BLOCK * self.block_bytes_per_token()
        tokens = max(BLOCK, most - most % BLOCK)
        while tokens > BLOCK and self.request_blocks(tokens) * per_block > cap_bytes:
            tokens -= BLOCK
        return tokens


def _gemma(name: str, layers: int, heads: int, head_dim: int, window: int, sliding: int, **kw: Any) -> Family:
    return Family(name, layers, heads, head_dim, (window,) * sliding + (None,), **kw)


#: the families kvbridge's connector accepts (the others are refused before scheduling: docs/vllm.md), vLLM 0.32's
#: groups of each (layers per group; sliding-window groups first)
ZOO = (
    Family("llama-3.1-8b", 32, 8, 128),
    Family("llama-3.1-70b", 80, 8, 128),
    Family("qwen3-8b", 36, 8, 128),
    Family("qwen3-32b", 64, 8, 128),
    Family("qwen3-30b-a3b", 48, 4, 128),
    Family("qwen3-235b-a22b", 94, 4, 128),
    Family("glm-4.5", 92, 8, 128),
    Family("mistral-small-3.1-24b", 40, 8, 128),
    Family("phi-4", 40, 10, 128),
    Family("deepseek-v3", 61, 1, 576, mla=True, cross_layer=False),
    Family("kimi-k2", 61, 1, 576, mla=True, cross_layer=False),
    Family("gpt-oss-20b", 12, 8, 64, (128, None)),  # sliding 12, full 12
    Family("gpt-oss-120b", 18, 8, 64, (128, None)),  # sliding 18, full 18
    _gemma("gemma-3-1b", 4, 1, 256, 512, 6),  # 4, 4, 4, 4, 3, 3 sliding; 4 full
    _gemma("gemma-3-12b", 8, 8, 256, 1024, 5),  # 5 x 8 sliding; 8 full
    _gemma("gemma-3-27b", 10, 16, 128, 1024, 6, cross_layer=False),  # 9, 9, 9, 9, 8, 8 sliding; 10 full
)


def zoo_families(names: Sequence[str] = ()) -> list[Family]:
    """The families of a run (``names``: those)."""
    if not names:
        return list(ZOO)
    unknown = sorted(set(names) - {f.name for f in ZOO})
    if unknown:
        raise ValueError(f"no zoo family {', '.join(unknown)}; the families: {', '.join(f.name for f in ZOO)}")
    return [f for f in ZOO if f.name in names]


def zoo_cache_bytes(families: Sequence[Family], most: int = MOST_TOKENS) -> int:
    """Bytes of the largest case's caches (both sides, every rank)."""
    return max(
        cache_bytes(f.model, case, f.request_blocks(f.prompt_tokens(most)) * BLOCK)
        for f in families
        for case in f.cases()
    )


def run_family(
    allocate: Allocate, family: Family, prefills: Sequence[Prefill], requests: int, most: int = MOST_TOKENS
) -> list[dict[str, Any]]:
    """Every case of one family (contiguous and scattered block ids), its rows named after the family."""
    from .layouts import run_case  # the layouts bench imports this module

    tokens = family.prompt_tokens(most)
    moved = family.request_blocks(tokens) * BLOCK  # the request's blocks, as tokens of a one-group cache
    rows = []
    for case in family.cases():
        for row in run_case(allocate, family.model, case, prefills, moved, requests):
            row["name"] = f"{case.name}-{family.name}-{row['blockIds']}"
            row["family"] = family.name
            row["promptTokens"] = tokens
            row["kvBytesPerTokenPerRank"] = round(family.bytes_per_token(tokens, case.decode.tp))
            rows.append(row)
    return rows
