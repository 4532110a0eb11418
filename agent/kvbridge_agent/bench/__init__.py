"""The agent's measurements: ``kvbridge-agent bench`` and ``kvbridge-agent loopback``.

Reading order:
- ``measure``: ``kvbridge-agent bench``: memcpy and raw-NIXL ceilings, kvbridge's throughput and overhead.
- ``layouts``: ``kvbridge-agent bench --layouts``: vLLM's physical layouts against raw NIXL and memcpy.
- ``plot``: the bench's figure.
- ``loopback``: ``kvbridge-agent loopback``: one prefill and one decode engine, every byte verified.
"""
