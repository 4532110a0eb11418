"""The agent's measurements: ``kvbridge-agent bench`` and ``kvbridge-agent loopback``.

Reading order:
- ``measure``: ``kvbridge-agent bench``: memcpy and raw-NIXL ceilings, kvbridge's throughput and overhead.
- ``layouts``: ``kvbridge-agent bench --layouts``: vLLM's physical layouts against raw NIXL and memcpy.
- ``layout_cases``: its cases: layout pairs, geometries, cache sizes, block ids.
- ``layout_prefill``: its prefill side: a case's caches as vLLM builds them, a prefill rank here or in a process.
- ``layout_report``: its targets and printed table (direct and staged reads side by side).
- ``layout_zoo``: ``--layouts --zoo``: the model zoo's geometries (hybrid groups, MLA) as cases.
- ``plot``: the bench's figure.
- ``loopback``: ``kvbridge-agent loopback``: one prefill and one decode engine, every byte verified.
"""
