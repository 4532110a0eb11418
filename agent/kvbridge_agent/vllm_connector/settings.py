"""What the connector needs to know, from kvbridge's environment contract and vLLM's own configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import KVLayout, ModelGeometry, Role, SpecError, TransferSettings
from kvbridge_agent.core.cache_groups import CacheGroups
from kvbridge_agent.core.contract import EngineEnvironment, parse_environment
from kvbridge_agent.core.plan import plan_or_problems

#: vLLM's KV roles and kvbridge's
_ROLES = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}


@dataclass(frozen=True)
class ConnectorSettings:
    """One engine's view of the pair: the model, both roles' settings, the transfer settings, its own identity."""

    role: Role
    environment: EngineEnvironment
    block_size: int
    tp_size: int
    #: vLLM's ``kv_buffer_device: cpu`` off the CPU build: NIXL moves a host mirror of the cache (transfer.host_buffer)
    host_buffer: bool = False
    #: a hybrid model's KV cache groups (vLLM's hybrid allocator), and each group's layer names; ``None``: one group
    groups: CacheGroups | None = None
    group_layers: list[list[str]] | None = None
    #: the model's dtype (vLLM's ``--dtype``, a torch dtype) and the KV cache's (``--kv-cache-dtype``): what vLLM's CPU
    #: attention picks its kernel by, and with it the block interior (``None``: the cache tensor's own dtype)
    model_dtype: Any = None
    kv_cache_dtype: str = "auto"
    #: the longest request vLLM runs (``--max-model-len``): decode refuses transfer parameters of more tokens
    #: (``None``: not known, the schema's bound)
    max_model_len: int | None = None
    #: the model's sliding window in tokens as vLLM reads it (``model_config.get_sliding_window()``); ``None``: none
    sliding_window: int | None = None

    @property
    def model(self) -> ModelGeometry:
        return self.environment.model

    @property
    def transfer(self) -> TransferSettings:
        return self.environment.transfer

    @property
    def fingerprint(self) -> str:
        return self.environment.fingerprint

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, environ: Mapping[str, str] = os.environ, *, cpu_build: bool = True
    ) -> ConnectorSettings:
        """The contract from the environment, checked against what vLLM actually runs (block size, TP size,
        role): a pod whose vLLM flags disagree with the contract fails at start-up, not with wrong tokens.
        ``cpu_build``: vLLM's CPU build, whose attention cache is head-major only; elsewhere the connector reads
        the layout vLLM resolved (``VLLM_KV_CACHE_LAYOUT``, rendered from the role's ``kvLayout``) by its strides,
        where it lies, or through a host mirror with ``kv_buffer_device: cpu``."""
        transfer_config = vllm_config.kv_transfer_config
        role = _ROLES.get(str(transfer_config.kv_role))
        if role is None:
            raise SpecError(
                f"kv_role {transfer_config.kv_role!r}: KVBridgeConnector runs kv_producer (prefill) or kv_consumer "
                "(decode) engines",
                field="kv_transfer_config.kv_role",
                code="CONNECTOR_ROLE",
            )
        environment = parse_environment(environ, role=role.value)
        block_size = int(vllm_config.cache_config.block_size)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        own = environment.own
        for name, have, want in (
            ("blockSize", block_size, own.block_size),
            ("tensorParallelSize", tp_size, own.tensor_parallel_size),
        ):
            if have != want:
                raise SpecError(
                    f"vLLM runs {name} {have} but the environment contract says {want} for {role.value}: start vLLM "
                    "with the arguments kvbridge rendered",
                    field=f"spec.{role.value}.{name}",
                    code="CONNECTOR_MISMATCH",
                )
        environment = data_parallel_rank(environment, vllm_config)
        # a host buffer for nodes without GPUDirect RDMA; on the CPU build the cache is in host memory already
        host_buffer = not cpu_build and str(getattr(transfer_config, "kv_buffer_device", "cuda")) == "cpu"
        if cpu_build and own.kv_layout is not KVLayout.HND:
            raise SpecError(
                f"{role.value} kvLayout {own.kv_layout.value}: the connector reads vLLM's head-major caches (HND)",
                field=f"spec.{role.value}.kvLayout",
                code="CONNECTOR_MISMATCH",
            )
        result = plan_or_problems(environment.model, environment.prefill, environment.decode, environment.transfer)
        if isinstance(result, list):
            raise SpecError(
                "; ".join(f"{p.code} at {p.field}: {p.message}" for p in result),
                field=result[0].field,
                code="INCOMPATIBLE",
            )
        if not environment.fingerprint:
            environment = environment.model_copy(update={"fingerprint": result.fingerprint})
        model_config = getattr(vllm_config, "model_config", None)
        model_dtype = getattr(model_config, "dtype", None)
        kv_cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        max_model_len = getattr(model_config, "max_model_len", None)
        window = getattr(model_config, "get_sliding_window", None)
        sliding_window = window() if callable(window) else None
        return cls(
            role,
            environment,
            block_size,
            tp_size,
            host_buffer,
            model_dtype=model_dtype,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=int(max_model_len) if max_model_len else None,
            sliding_window=int(sliding_window) if isinstance(sliding_window, int) and sliding_window > 0 else None,
        )


def data_parallel_rank(environment: EngineEnvironment, vllm_config: Any) -> EngineEnvironment:
    """The environment of the data-parallel rank this engine core is, as vLLM names it: its index
    (``parallel_config.data_parallel_index``, kept for dense models too, whose DP ranks vLLM runs as independent
    engines of DP size 1), the engine id ``<pod>_dp<index>`` and the side channel on base port + index, as vLLM's
    NixlConnector offsets ``VLLM_NIXL_SIDE_CHANNEL_PORT``. An index outside the role's ``dataParallelSize`` means
    vLLM was started with other arguments than kvbridge rendered."""
    index = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    size = environment.own.data_parallel_size
    if not 0 <= index < size:
        raise SpecError(
            f"vLLM runs data-parallel rank {index} but the environment contract says {size} rank(s) for "
            f"{environment.role.value}: start vLLM with the arguments kvbridge rendered",
            field=f"spec.{environment.role.value}.dataParallelSize",
            code="CONNECTOR_MISMATCH",
        )
    return environment.of_data_parallel_rank(index)
