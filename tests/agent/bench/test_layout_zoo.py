"""``kvbridge-agent bench --layouts --zoo``: its table is the zoo's (``kvbridge model`` on each config.json, vLLM's
own grouping), its requests are capped, and a tiny run of a dense, an MLA and a hybrid family reports sane figures
(prefill and decode in this process, real NIXL on DRAM, vLLM's allocator). Figures are not asserted: a benchmark."""

from __future__ import annotations

import pytest

from kvbridge_agent.bench.layout_zoo import BLOCK, CAP_BYTES, ZOO, Family, run_family, zoo_families


def test_the_table_is_vllms_cache_of_every_zoo_family_kvbridge_accepts() -> None:
    """Per family: its ``spec.model`` from the zoo's config.json (``kvbridge model``), vLLM 0.32's KV cache groups
    of it (``get_kv_cache_groups``: layers per group, sliding windows) and whether the plan accepts it at all."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from tests.zoo.vllm_caches import kv_cache_config
    from tests.zoo.zoo import ZOO as MEMBERS

    accepted = {m.folder: m for m in MEMBERS if not m.refused}
    assert sorted(f.name for f in ZOO) == sorted(accepted)
    for family in ZOO:
        model = accepted[family.name].model()
        groups = kv_cache_config(model, BLOCK, 1, KVCacheLayout.LBHNC).kv_cache_groups
        windows = tuple(
            g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None for g in groups
        )
        assert family.windows == windows, family.name
        assert family.layers == max(len(g.layer_names) for g in groups), family.name
        assert (family.kv_heads, family.head_dim, family.mla) == (model.num_kv_heads, model.head_dim, model.is_mla)
        padded = len({len(g.layer_names) for g in groups}) > 1
        assert family.cross_layer == (not model.is_mla and not (padded and model.num_kv_heads > 1)), family.name


@pytest.mark.parametrize("family", ZOO, ids=[f.name for f in ZOO])
def test_requests_are_capped_and_hybrids_move_each_groups_kept_blocks(family: Family) -> None:
    tokens = family.prompt_tokens()
    assert tokens % BLOCK == 0
    assert tokens == BLOCK or family.request_blocks(tokens) * BLOCK * family.block_bytes_per_token() <= CAP_BYTES
    dense = -(-tokens // BLOCK)
    if family.windows == (None,):
        assert family.request_blocks(tokens) == dense
    else:  # every group its blocks; a sliding one only its window's past the window
        assert family.request_blocks(tokens) <= len(family.windows) * dense
        assert family.request_blocks(4096) < len(family.windows) * 4096 // BLOCK
    names = [c.name for c in family.cases()]
    assert names[0] == "LBHNC"
    assert ("BHLNC" in names) == family.cross_layer
    assert ("LBHNC-tp2to1" in names) == (family.kv_heads >= 2 and not family.mla)


def test_unknown_families_are_named() -> None:
    assert [f.name for f in zoo_families(["kimi-k2", "phi-4"])] == ["phi-4", "kimi-k2"]  # the table's order
    with pytest.raises(ValueError, match="no zoo family nope"):
        zoo_families(["nope"])


@pytest.mark.parametrize("name", ["qwen3-8b", "deepseek-v3", "gpt-oss-20b", "gemma-3-1b"])
def test_a_tiny_run_of_a_family_reports_sane_figures(name: str) -> None:
    """A dense family, an MLA one, an alternating hybrid and a padded one, 48-token prompts (each family's real
    layers and heads; few tokens): one row per case and block allocation, the family's bytes, descriptors that
    add up, a ratio to raw NIXL measured beside it."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    from kvbridge_agent.bench.layout_prefill import LocalPrefill
    from kvbridge_agent.vllm_connector.host_cache import allocate_host_views

    (family,) = zoo_families([name])
    tokens = 48
    rows = run_family(allocate_host_views, family, [LocalPrefill(), LocalPrefill()], 1, most=tokens)
    assert [(r["case"], r["blockIds"]) for r in rows] == [
        (c.name, a) for c in family.cases() for a in ("contiguous", "scattered")
    ]
    blocks = family.request_blocks(tokens)
    for row in rows:
        assert row["name"] == f"{row['case']}-{name}-{row['blockIds']}"
        assert row["family"] == name
        assert row["promptTokens"] == tokens
        assert row["bytesPerRequest"] == blocks * BLOCK * family.block_bytes_per_token()
        assert row["kvBytesPerTokenPerRank"] == round(row["bytesPerRequest"] / tokens)
        assert row["bytesPerDescriptor"] * row["descriptorsPerRequest"] == row["bytesPerRequest"]
        if row["blockIds"] == "scattered" and row["case"] == "LBHNC":  # one run per layer slot and block
            assert row["descriptorsPerRequest"] == family.layers * blocks
        assert row["gbps"] > 0
        assert row["rawHereGBps"] > 0
        assert row["ratioToRawHere"] == pytest.approx(row["gbps"] / row["rawHereGBps"], abs=2e-3)
