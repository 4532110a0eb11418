"""Two engines' KV caches as vLLM 0.32 builds them, driven as vLLM's scheduler drives them, with kvbridge's connector
halves on both: the harness of the allocator proofs (test_padded_groups.py, test_window_edges.py, and every zoo family
plan accepts: tests/zoo/test_zoo_edges.py).

- the cache: the model's per-layer ``KVCacheSpec`` (full attention, sliding window, or MLA's one latent) -> vLLM's
  ``get_kv_cache_groups`` (its grouping and padding of a hybrid model) -> ``get_kv_cache_config_from_groups`` ->
  ``allocate_kv_cache`` on host memory, in a resolved ``KVCacheLayout``;
- the block tables: vLLM's own ``KVCacheManager`` (prefix caching on), called as vLLM's scheduler calls it —
  prefill hands the connector the new request (``on_new_request``: with sliding windows it drops the prompt's last
  token), allocates the prompt, frees what the windows skip and finishes the request; decode looks up its prefix
  cache, asks the connector for the external tokens, allocates them (``delay_cache_blocks``) and hands the
  connector its blocks;
- the transfer: both connector halves with real NIXL on DRAM, kvbridge's side channel, verification ``All``.

Content is position-tagged per (model layer, block, head, token, unit, request) so a byte in the wrong place shows.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge_agent.core import Attention, ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.vllm_connector.connector import cache_groups
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker

TIMEOUT = 30.0
init_none_hash(sha256)


@dataclass(frozen=True)
class Model:
    """A hybrid model as vLLM sees it: per layer its sliding window in tokens (``None``: full attention); with
    ``mla``, every layer holds one latent vector of ``head_size`` per token (vLLM's ``MLAAttentionSpec``: one head,
    no separate V)."""

    windows: tuple[int | None, ...]
    block: int = 16
    heads: int = 2
    head_size: int = 64
    num_blocks: int = 96
    mla: bool = False
    #: the model the connector is told, scaled to ``heads`` and ``head_size`` (a zoo family's ``spec.model``);
    #: ``None``: a dense model of these layers
    spec: ModelGeometry | None = field(default=None, compare=False)

    @property
    def names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(len(self.windows))]

    @property
    def units(self) -> int:
        """Elements per (head, token) of a block: K and V, or MLA's latent vector."""
        return self.head_size if self.mla else 2 * self.head_size

    def specs(self) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        for name, window in zip(self.names, self.windows, strict=True):
            shape = {"block_size": self.block, "num_kv_heads": self.heads, "head_size": self.head_size}
            if self.mla:
                specs[name] = MLAAttentionSpec(**shape, dtype=torch.bfloat16)
            elif window is None:
                specs[name] = FullAttentionSpec(**shape, dtype=torch.bfloat16)
            else:
                specs[name] = SlidingWindowSpec(**shape, dtype=torch.bfloat16, sliding_window=window)
        return specs

    def vllm_config(self, layout: KVCacheLayout) -> Any:
        """What ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups`` read of vLLM's config."""
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
            attention_config=SimpleNamespace(hisparse_config=None),
            speculative_config=None,
            cache_config=SimpleNamespace(
                get_resolved_kv_cache_layout=lambda: layout,
                prefix_cache_retention_interval=None,
                num_gpu_blocks_override=self.num_blocks,
            ),
        )

    def kv_cache_config(self, layout: KVCacheLayout) -> KVCacheConfig:
        vllm_config = self.vllm_config(layout)
        groups = get_kv_cache_groups(vllm_config, self.specs())
        page = next(iter(self.specs().values())).page_size_bytes
        return get_kv_cache_config_from_groups(vllm_config, groups, page * len(self.windows) * self.num_blocks)

    @property
    def geometry(self) -> ModelGeometry:
        if self.spec is not None:
            facts = self.spec.model_dump(include=set(ModelGeometry.model_fields))
            return ModelGeometry.model_validate({**facts, "num_kv_heads": self.heads, "head_dim": self.head_size})
        return ModelGeometry(
            name="allocator",
            num_layers=len(self.windows),
            num_kv_heads=self.heads,
            head_dim=self.head_size,
            attention=Attention.MLA if self.mla else Attention.DENSE,
        )


def settings(model: Model, role: Role, config: KVCacheConfig, verification: str = "All") -> ConnectorSettings:
    """One role's connector settings, as ``KVBridgeConnector.__init__`` makes them from vLLM's KVCacheConfig."""
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-allocator",
        model=model.geometry,
        prefill=RoleSettings(block_size=model.block),
        decode=RoleSettings(block_size=model.block),
        transfer={"verification": verification},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer" if role is Role.PREFILL else "kv_consumer"),
        cache_config=SimpleNamespace(block_size=model.block),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    base = ConnectorSettings.from_vllm(vllm_config, render_environment(env), cpu_build=False)
    groups = cache_groups(config)
    layers = [list(group.layer_names) for group in config.kv_cache_groups]
    return dataclasses.replace(base, groups=groups, group_layers=layers)


def seeds(tokens: list[int], block: int) -> list[int]:
    """Per block of a prompt, what its KV is a function of: the tokens up to its end (same prefix, same KV)."""
    return [zlib.crc32(bytes(str(tokens[: (i + 1) * block]), "ascii")) for i in range(-(-len(tokens) // block))]


def tag(layer: int, seed: int, heads: int, tokens: int, units: int) -> torch.Tensor:
    """``[H, N, C]`` int16 content of one block of one model layer, whose prefix is ``seed``."""
    return tags(layer, [seed], heads, tokens, units)[0]


def tags(layer: int, seeds: list[int], heads: int, tokens: int, units: int) -> torch.Tensor:
    """``[len(seeds), H, N, C]``: :func:`tag` of each of ``seeds`` at once."""
    prefix = [(layer * 7919 + seed % 65521 * 104729) % 65521 for seed in seeds]
    value = (torch.tensor(prefix, dtype=torch.int32).view(-1, 1, 1, 1) + _positions(heads, tokens, units)) % 65521
    return (value - 32768).to(torch.int16)


@functools.cache
def _positions(heads: int, tokens: int, units: int) -> torch.Tensor:
    """The part of :func:`tag`'s content that depends on the position in the block, modulo 65521."""
    h = torch.arange(heads).view(-1, 1, 1)
    n = torch.arange(tokens).view(1, -1, 1)
    c = torch.arange(units).view(1, 1, -1)
    return ((h * 1299709 + n * 15485863 + c * 32452843 + 7) % 65521).to(torch.int32)


@dataclass
class Engine:
    """One engine: vLLM's KVCacheConfig, its allocator's views, its KVCacheManager, the connector's halves."""

    model: Model
    role: Role
    layout: KVCacheLayout
    config: KVCacheConfig = field(init=False)
    views: dict[str, torch.Tensor] = field(init=False)
    manager: KVCacheManager = field(init=False)
    scheduler: ConnectorScheduler = field(init=False)
    worker: ConnectorWorker = field(init=False)

    def __post_init__(self) -> None:
        self.config = self.model.kv_cache_config(self.layout)
        self.views = allocate_kv_cache(self.config, torch.device("cpu"), self.layout)
        self.manager = KVCacheManager(
            self.config,
            max_model_len=self.model.block * self.model.num_blocks,
            scheduler_block_size=self.model.block,
            hash_block_size=self.model.block,
            enable_caching=True,
        )
        self.scheduler = ConnectorScheduler(settings(self.model, self.role, self.config))
        self.worker = ConnectorWorker(self.scheduler.settings, 0, f"inc-{self.role.value}")

    def slots(self) -> dict[str, torch.Tensor]:
        """One view per distinct layer slot of the allocation (overlaid groups' layers share theirs)."""
        seen: dict[tuple[int, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
        for name, view in self.views.items():
            seen.setdefault((view.data_ptr(), view.stride()), (name, view))
        return dict(seen.values())

    def register(self) -> None:
        self.worker.register_kv_caches(self.views, self.layout.name)

    @property
    def group_layers(self) -> list[list[int]]:
        """Per cache group, the model layers (indices) it holds, in the group's order."""
        names = self.model.names
        return [[names.index(n) for n in group.layer_names] for group in self.config.kv_cache_groups]

    def request(self, request_id: str, tokens: list[int], params: dict[str, Any]) -> Request:
        hasher = get_request_block_hasher(self.model.block, sha256)
        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        return Request(request_id, list(tokens), sampling, None, block_hasher=hasher)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@dataclass
class Moved:
    """One request moved: both engines' block tables as vLLM's managers gave them, and decode's outcome."""

    #: the tokens prefill computed and offered (the prompt, or all but its last token: window_backoff)
    tokens: list[int]
    prefill_table: tuple[list[int], ...]
    decode_table: tuple[list[int], ...]
    failures: list[str]  # codes of decode's failed reads
    load_errors: set[int]
    params: dict[str, Any]
    local_hit: int  # tokens decode's own prefix cache held
    #: decode's cache before the request: per layer name, ``[blocks, H, N, C]`` int16
    before: dict[str, torch.Tensor]
    #: the first token decode's forward computes once the load is done: the first one not loaded, or the prompt's
    #: last, which vLLM recomputes when all were loaded (``Scheduler._update_waiting_for_remote_kv``)
    computes_from: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures and not self.load_errors


def compute_prompt(prefill: Engine, request_id: str, tokens: list[int]) -> tuple[Request, tuple[list[int], ...]]:
    """Prefill computes the prompt as vLLM's scheduler allocates it (its prefix cache first): each block it computes
    gets, in each layer of the group holding it, the content of its prefix. Before allocating, the connector sees
    the new request (it may drop the prompt's last token: window_backoff); once computed, vLLM frees the blocks
    the sliding windows skip, before the connector is handed the table (``Scheduler._connector_finished``)."""
    request = prefill.request(request_id, tokens, {"do_remote_decode": True})
    prefill.scheduler.on_new_request(request)
    tokens = list(request.prompt_token_ids or ())
    computed, hit, _boundary = prefill.manager.get_computed_blocks(request)
    blocks = prefill.manager.allocate_slots(request, len(tokens) - hit, hit, computed)
    assert blocks is not None, "prefill's cache is full"
    table = prefill.manager.get_block_ids(request_id)
    m = prefill.model
    prefixes = seeds(tokens, m.block)
    for layers, ids in zip(prefill.group_layers, table, strict=True):
        # computed now (a hit block holds the same prefix already)
        now = [(index, block) for index, block in enumerate(ids[: len(prefixes)]) if block and index >= hit // m.block]
        if not now:
            continue
        blocks = torch.tensor([block for _index, block in now])
        for layer in layers:
            content = tags(layer, [prefixes[index] for index, _block in now], m.heads, m.block, m.units)
            prefill.views[m.names[layer]].view(torch.int16)[blocks] = content
    request.num_computed_tokens = len(tokens)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    prefill.manager.remove_skipped_blocks(request_id, len(tokens), num_prompt_tokens=len(tokens))
    return request, tuple(list(group) for group in prefill.manager.get_block_ids(request_id))


def move(prefill: Engine, decode: Engine, request_id: str, tokens: list[int]) -> Moved:
    """One request through both engines: prefill computes and finishes it (``request_finished`` offers it), decode
    takes it as vLLM's scheduler does (prefix cache, connector, ``allocate_slots`` with ``delay_cache_blocks``,
    ``update_state_after_alloc``) and the connector reads it; then both free it (kept in their prefix caches)."""
    request, prefill_table = compute_prompt(prefill, f"p-{request_id}", tokens)
    delay, answer = prefill.scheduler.request_finished(request, prefill_table)
    if not delay or answer is None:
        prefill.manager.free(request)
        raise AssertionError(f"prefill did not offer the request: {answer}")
    prefill.worker.start_load_kv(prefill.scheduler.build_connector_meta())
    prefill.scheduler.take_digests(prefill.worker.stats.take())
    before = {name: view.view(torch.int16).clone() for name, view in decode.slots().items()}
    wanted = decode.request(f"d-{request_id}", tokens, dict(answer))
    computed, hit, _boundary = decode.manager.get_computed_blocks(wanted)
    external, asynchronous = decode.scheduler.get_num_new_matched_tokens(wanted, hit)
    offered = int(answer["kvbridge"]["numTokens"])
    assert asynchronous is True
    assert external == offered - hit, (external, offered, hit)
    blocks = decode.manager.allocate_slots(
        wanted, 0, hit, computed, num_external_computed_tokens=external, delay_cache_blocks=True
    )
    assert blocks is not None, "decode's cache is full"
    decode_table = tuple(list(group) for group in decode.manager.get_block_ids(wanted.request_id))
    decode.scheduler.update_state_after_alloc(wanted, decode.manager.get_blocks(wanted.request_id), external)
    failures = run_decode(prefill, decode, wanted.request_id)
    errors = decode.worker.get_block_ids_with_load_errors()
    if not failures and not errors:  # vLLM caches the loaded blocks once the load is done
        decode.manager.cache_blocks(wanted, offered)
    decode.manager.free(wanted)
    finish_prefill(prefill, request, "KV_DIGEST_MISMATCH" in failures or not failures)
    params = answer["kvbridge"]
    computes_from = offered if offered < len(tokens) else len(tokens) - 1
    return Moved(tokens[:offered], prefill_table, decode_table, failures, errors, params, hit, before, computes_from)


def run_decode(prefill: Engine, decode: Engine, request_id: str) -> list[str]:
    """Start decode's reads and drive both workers until decode reports the request (verified, or failed): the
    codes of the reads that failed, as the connector's metrics count them."""
    worker = decode.worker
    worker.stats.take()
    worker.start_load_kv(decode.scheduler.build_connector_meta())
    deadline = time.monotonic() + TIMEOUT
    done: set[str] = set()
    while request_id not in done:
        assert time.monotonic() < deadline, "the transfer did not finish"
        prefill.worker.get_finished(set())
        _sending, received = worker.get_finished(set())
        done |= received or set()
        time.sleep(0.001)
    stats = worker.stats.take()
    return list(stats.data.get("failed_reads", [])) if stats is not None else []


def finish_prefill(prefill: Engine, request: Request, read: bool) -> None:
    """Prefill frees the request's blocks once its reader is done (or at once when nothing was read)."""
    rank = prefill.worker.prefill
    assert rank is not None
    deadline = time.monotonic() + TIMEOUT
    while read and request.request_id in rank.pending:
        assert time.monotonic() < deadline, "prefill was never notified"
        prefill.worker.get_finished({request.request_id})
        time.sleep(0.001)
    rank.forget(request.request_id)
    prefill.worker.get_finished({request.request_id})
    prefill.manager.free(request)


def check_bytes(decode: Engine, moved: Moved) -> None:
    """Where decode's vLLM reads the request — each group's blocks in its table that are not the null block, in
    that group's layers — decode holds the content of that prefix; no block outside the request was written."""
    m = decode.model
    prefixes = seeds(moved.tokens, m.block)
    mine: set[int] = set()
    for layers, ids in zip(decode.group_layers, moved.decode_table, strict=True):
        held = [(index, block) for index, block in enumerate(ids[: len(prefixes)]) if block]
        if not held:
            continue
        mine.update(block for _index, block in held)
        blocks = torch.tensor([block for _index, block in held])
        for layer in layers:
            got = decode.views[m.names[layer]].view(torch.int16)[blocks]
            want = tags(layer, [prefixes[index] for index, _block in held], m.heads, m.block, m.units)
            if not torch.equal(got, want):
                index, block = next(
                    (i, b) for (i, b), g, w in zip(held, got, want, strict=True) if not torch.equal(g, w)
                )
                raise AssertionError(f"layer {layer}, block {block} (position {index}) differs")
    for name, view in decode.slots().items():
        now = view.view(torch.int16)
        written = torch.ne(now, moved.before[name]).reshape(now.shape[0], -1).any(dim=1).nonzero().flatten()
        outside = sorted(set(written.tolist()) - mine)
        assert not outside, f"{name}: blocks {outside[:8]} outside the request were written"


def window_gaps(decode: Engine, moved: Moved) -> list[str]:
    """Where decode's first forward after the load would read the null block: for each sliding-window group, the
    tokens its window reaches before ``moved.computes_from`` whose block in decode's table is the null block (the
    tokens it reaches are ``window - 1`` before it). Empty when every one holds KV (check_bytes checks which)."""
    gaps = []
    first = moved.computes_from
    for index, group in enumerate(decode.config.kv_cache_groups):
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        if window is None:
            continue
        table = moved.decode_table[index]
        for token in range(max(0, first - window + 1), first):
            block = token // decode.model.block
            if block >= len(table) or table[block] == 0:
                gaps.append(f"group {index} (window {window}): token {token} of the {first} before the first computed")
    return gaps


def window_table(block: int, window: int, extra: int, length: int) -> list[int]:
    """:func:`manager_table` for one sliding-window group (``extra`` tokens retained beyond the window)."""
    spec = SlidingWindowSpec(
        block_size=block,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.bfloat16,
        sliding_window=window,
        extra_retained_tokens=extra,
    )
    return manager_table(spec, length)


def manager_table(spec: KVCacheSpec, length: int) -> list[int]:
    """The block table vLLM's ``KVCacheManager`` gives decode for a transferred prompt of ``length`` tokens (all
    external, allocated at once) in a model of one cache group of ``spec``."""
    blocks = -(-length // spec.block_size) + 2
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    manager = KVCacheManager(
        config,
        max_model_len=blocks * spec.block_size,
        scheduler_block_size=spec.block_size,
        hash_block_size=spec.block_size,
        enable_caching=True,
    )
    hasher = get_request_block_hasher(spec.block_size, sha256)
    sampling = SamplingParams(max_tokens=1)
    request = Request("r", list(range(length)), sampling, None, block_hasher=hasher)
    empty = manager.empty_kv_cache_blocks
    allocated = manager.allocate_slots(
        request, 0, 0, empty, num_external_computed_tokens=length, delay_cache_blocks=True
    )
    assert allocated is not None
    return list(manager.get_block_ids("r")[0])
