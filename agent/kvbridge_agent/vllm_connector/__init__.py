"""kvbridge inside vLLM: ``KVBridgeConnector``, a vLLM v1 KV connector built on the agent's core and runtime.

vLLM loads it from the KV transfer configuration::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge_agent.vllm_connector", "kv_role": "kv_producer"}'

and the engine's settings come from kvbridge's environment contract (docs/environment.md), which the operator
renders into the pod. This package is the only place in kvbridge that imports vllm (import-linter keeps it so).
"""

from .connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
