"""kvbridge inside vLLM: ``KVBridgeConnector``, a vLLM v1 KV connector built on the agent's core and runtime.

Reading order:
- ``connector``: the class vLLM instantiates; each hook goes to the half of the same name.
- ``settings``: what the connector needs, from kvbridge's environment contract and vLLM's configuration.
- ``messages``: what the two halves tell each other, and the ``kv_transfer_params``.
- ``scheduler``: the scheduler half: which requests to read or offer, leases, the side-channel listener.
- ``window_backoff``: sliding windows: prefill leaves the prompt's last token to decode, which computes it.
- ``worker``: the worker half: one TP rank's KV cache on kvbridge's rank machinery.
- ``verifying``: verification off vLLM's thread: prefill's digests and decode's checks on threads of their own.
- ``digest_relay``: prefill's digests from each rank to the scheduler's side channel the moment they are taken.
- ``staging``: staged reads: each rank's staging buffer from the environment, decode's bounded stager.
- ``stage_relay``: prefill's stage requests from the scheduler's side channel to the worker rank that packs them.
- ``failures``: a request's typed failure instead of vLLM's step; the handshakes refused, not queued.
- ``cache_geometry``: what vLLM's KV tensors are to kvbridge: geometry, the CPU build's layer slots of several cache
  groups, layout name, CPU kernel, refused conversions.
- ``cpu_blocks``: block-size conversions for vLLM's CPU attention cache.
- ``stats``: what the connector reports through vLLM's metrics.
- ``tracing``: the connector's spans, parented to the request's trace (``spec.tracing``).
- ``host_cache``: for the benchmark: vLLM's own allocator building a physical-layout cache on host memory.

vLLM loads it from the KV transfer configuration::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge_agent.vllm_connector", "kv_role": "kv_producer"}'

and the engine's settings come from kvbridge's environment contract (docs/environment.md), which the operator
renders into the pod. This package is the only place in kvbridge that imports vllm (import-linter keeps it so).
"""

from .connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
