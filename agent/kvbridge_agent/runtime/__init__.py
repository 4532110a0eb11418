"""The agent's I/O layer: KV cache tensors, NIXL transfers, the side channel, the engine worker.

Everything here executes plans computed by :mod:`kvbridge_agent.core`.
"""
