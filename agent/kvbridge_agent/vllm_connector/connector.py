"""``KVBridgeConnector``: the class vLLM instantiates, once in the scheduler and once per worker; it forwards.

Each of vLLM's hooks (``KVConnectorBase_V1``) goes to the method of the same name on the half that serves it:
``ConnectorScheduler`` (scheduler.py) in the scheduler, ``ConnectorWorker`` (worker.py) in each worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.cache_groups import CacheGroups
from kvbridge_agent.core.layout import rendered_order

from .messages import RankHandshake, StepMetadata
from .scheduler import ConnectorScheduler
from .settings import ConnectorSettings
from .stats import HOOKS_RECORDED_SECONDS, KVBridgePromMetrics, KVBridgeStats
from .worker import ConnectorWorker

if TYPE_CHECKING:
    import torch


def incarnation(vllm_config: Any) -> str:
    """One value for every TP rank of one engine start, new on every start: vLLM draws the KV engine id and the
    instance id once, in the front-end process, and hands both to every worker (either may be pinned by hand,
    hardly both)."""
    seed = f"{vllm_config.kv_transfer_config.engine_id}/{getattr(vllm_config, 'instance_id', '')}"
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def resolved_layout(vllm_config: Any) -> str | None:
    """The ``KVCacheLayout`` vLLM resolved for the cache, by name, where kvbridge reads the views by their strides;
    ``None`` on vLLM's CPU build, whose attention kernel keeps its own block interior (kvbridge's per-layer path,
    ``cpu_blocks``)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)


def require_checked_layout(resolved: str, settings: ConnectorSettings) -> None:
    """The layout vLLM resolved is the one the plan was checked with: kvbridge renders the role's ``kvLayout`` and
    the model's cache kind as ``VLLM_KV_CACHE_LAYOUT``, so anything else means the pod was started otherwise."""
    checked = settings.environment.own.kv_layout
    want = rendered_order(checked, settings.model.cache_kind).value
    if resolved != want:
        raise SpecError(
            f"vLLM resolved the KV cache layout {resolved}, but the plan was checked for kvLayout {checked.value} "
            f"and cache kind {settings.model.cache_kind.value} ({want}): start vLLM with the environment kvbridge "
            f"rendered (VLLM_KV_CACHE_LAYOUT={want})",
            field="kv_cache_layout",
            code="CONNECTOR_MISMATCH",
        )


def cache_groups(kv_cache_config: Any) -> CacheGroups | None:
    """A hybrid model's KV cache groups (vLLM's hybrid allocator: full-attention and sliding-window layers overlaid
    in one allocation, padded groups included); ``None`` for one group. Other kinds of group (state-space layers,
    chunked local attention) are refused: kvbridge moves attention KV only."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) < 2:
        return None
    windows: list[int | None] = []
    retained: list[int] = []
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windows.append(int(spec.sliding_window))
            retained.append(int(getattr(spec, "extra_retained_tokens", 0) or 0))
        elif isinstance(spec, FullAttentionSpec):
            windows.append(None)
            retained.append(0)
        else:
            raise SpecError(
                f"a KV cache group of {type(spec).__name__}: KVBridgeConnector moves full-attention and "
                "sliding-window groups only",
                field="spec.model",
                code="CONNECTOR_UNSUPPORTED",
            )
    sizes = {int(group.kv_cache_spec.block_size) for group in groups}
    if len(sizes) != 1:
        raise SpecError(
            f"KV cache groups of {sorted(sizes)}-token blocks: KVBridgeConnector moves groups of one block size",
            field="spec.model",
            code="CONNECTOR_UNSUPPORTED",
        )
    layers = [len(group.layer_names) for group in groups]
    return CacheGroups.of(windows, sizes.pop(), retained, layers)


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's KV transfer inside vLLM: CURVE side channel, the plan from the core once per prefill engine,
    NIXL READs, leases carried in ``kv_transfer_params``, stale-peer eviction; several cache groups (vLLM's hybrid
    allocator) as one list of blocks (core.cache_groups)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from vllm.platforms import current_platform

        settings = ConnectorSettings.from_vllm(vllm_config, cpu_build=current_platform.is_cpu())
        groups = cache_groups(kv_cache_config)
        if groups is not None:
            settings = dataclasses.replace(
                settings, groups=groups, group_layers=[list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
            )
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(settings)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = ConnectorWorker(settings, get_tensor_model_parallel_rank(), incarnation(vllm_config))
        #: worker: vLLM's thread in this step's hooks so far, and in earlier steps' too short to record (seconds)
        self._hooks_seconds = 0.0

    def _worker_half(self) -> ConnectorWorker:
        if self._worker is None:
            raise SpecError("a worker call reached the scheduler's connector", code="CONNECTOR_ROLE")
        return self._worker

    def _scheduler_half(self) -> ConnectorScheduler:
        if self._scheduler is None:
            raise SpecError("a scheduler call reached a worker's connector", code="CONNECTOR_ROLE")
        return self._scheduler

    # -- worker ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker_half()
        layout = resolved_layout(self._vllm_config)
        if layout is not None:
            require_checked_layout(layout, worker.settings)
        worker.register_kv_caches(kv_caches, layout)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.get_handshake_metadata() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        began = time.perf_counter()
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMetadata):
            self._worker_half().start_load_kv(meta)
        self._hooks_seconds += time.perf_counter() - began

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the whole request's KV arrives before vLLM schedules it (asynchronous load)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pull model: decode READs what prefill computed in place

    def wait_for_save(self) -> None:
        """After the step's forward: prefill digests the requests whose prompt it completed (their digests then
        travel in the transfer parameters the requests finish with)."""
        began = time.perf_counter()
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, StepMetadata) and meta.to_digest:
            self._worker.wait_for_save(meta)
        self._hooks_seconds += time.perf_counter() - began

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The step's last hook: also records how long vLLM's thread spent in this step's hooks (all kvbridge
        costs the step), once that reaches :data:`~.stats.HOOKS_RECORDED_SECONDS`."""
        began = time.perf_counter()
        worker = self._worker_half()
        finished = worker.get_finished(finished_req_ids)
        self._hooks_seconds += time.perf_counter() - began
        if self._hooks_seconds >= HOOKS_RECORDED_SECONDS:
            worker.stats.record_hooks(self._hooks_seconds)
            self._hooks_seconds = 0.0
        return finished

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        return self._worker.stats.take() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    # -- scheduler ---------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._scheduler_half().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_half().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half().request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_xfer_handshake_metadata(
                {r: m for r, m in metadata.items() if isinstance(m, RankHandshake)}
            )

    # -- metrics (classmethods: vLLM calls them in the front end, where no connector exists) ---------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self._scheduler, self._worker):
            if half is not None:
                half.shutdown()
