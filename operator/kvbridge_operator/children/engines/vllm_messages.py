"""The words of :mod:`.vllm_problems`'s problems: one template per problem, its fields named.

Each message says what vLLM (or its NixlConnector) would do with the spec and ends with the fix, ``set FIELD:
VALUE`` (the remedy search checks it); :mod:`.vllm_problems` decides when a problem applies and fills the fields.
"""

from __future__ import annotations

NIXL_UNVERIFIED_SAMPLED = (
    "verification: Sampled (the default) asks decode to check prefill's digest of a sample of the transfers, but "
    "vLLM's NixlConnector has no transfer digest: these engines run unverified (decode uses whatever it read); set "
    "spec.engine.connector: KVBridge to verify, or spec.transfer.verification: Off to say so"
)
NIXL_UNVERIFIED = (
    "verification: All asks decode to check every transfer against prefill's digest, but vLLM's NixlConnector has "
    "none (decode would use whatever it read); set spec.engine.connector: KVBridge, or "
    "spec.transfer.verification: Off to run unverified"
)
NIXL_UNSIGNED = (
    "signTransfers asks decode to accept kv_transfer_params only with the router's signature, but vLLM's "
    "NixlConnector uses whatever parameters it is handed (it cannot check one; kvbridge's connector does); set "
    "spec.engine.connector: KVBridge, or spec.router.signTransfers: false to go without"
)
MANAGED_BY_SOURCE = (
    "{flag} is set by kvbridge from spec.model.source and spec.model.name; remove it from extraArgs (pin a "
    "revision with source: hf://ORG/NAME@REVISION)"
)
MANAGED = (
    "{flag} is set by kvbridge from the spec (it must agree with the compatibility plan); remove it from extraArgs "
    "and set {field} instead"
)
UNMODELLED = (
    "{flag} {why}, which kvbridge's plan, GPU requests and compatibility rules do not model; remove it from extraArgs"
)
MLA_BLOCK_SIZE = (
    "vLLM serves MLA on GPUs with its {backend} backend (kvbridge renders --attention-backend {backend}), which runs "
    "only {size}-token blocks, and {role} has {have}; set spec.{role}.blockSize: {size}{other}"
)
PREFILL_CONVERSION = (
    "the plan needs the prefill side to {kind} ({source} -> {target}), which vLLM's NixlConnector cannot do (only "
    "the decode side re-lays blocks there); set spec.prefill.{where}: {target}, or spec.engine.connector: KVBridge"
)
CPU_BLOCK_SIZE = (
    "vLLM's CPU attention runs blocks of a multiple of {multiple} tokens, not {have} (vLLM fails at start-up); set "
    "spec.{role}.blockSize: {fits}{both}"
)
CPU_KV_LAYOUT = (
    "vLLM's CPU attention supports only the head-major layout (LBHNC); {have} is refused at start-up; set "
    "spec.{role}.kvLayout: HND"
)
KVBRIDGE_REPLICATED_HEADS = (
    "TP {tp} replicates the model's {heads} KV heads; KVBridgeConnector moves CPU attention's cache by whole heads; "
    "set spec.{role}.tensorParallelSize: {heads}"
)
CPU_BLOCK_SIZE_RATIO = (
    "prefill blocks of {prefill} and decode blocks of {decode} tokens: vLLM's NixlConnector re-lays received blocks "
    "as [heads, tokens, dim], but CPU attention keeps each head's keys and then its values inside a block, so decode "
    "computes with scrambled KV and returns wrong tokens without an error; set {fix}"
)
KV_BUFFER_DEVICE = (
    "vLLM's CPU build keeps the KV cache in host memory and has no GPU memory to move it from (vLLM refuses "
    "kv_buffer_device cuda there); set spec.transfer.network.kvBufferDevice: cpu"
)
CPU_CACHE_KIND = (
    "vLLM's CPU attention has one per-layer cache layout; {kind} is a GPU attention backend's layout; set "
    "spec.model.cacheKind: Split"
)
CPU_KV_CACHE_DTYPE = (
    "vLLM's CPU build does not transfer fp8 KV caches (its CPU KV packing refuses them); set "
    "spec.model.kvCacheDtype: bfloat16"
)
