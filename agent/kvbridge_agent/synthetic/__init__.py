"""The synthetic engine worker (``kvbridge-agent serve``): an engine without a model that moves real KV bytes.

Reading order:
- ``serve``: the process, until SIGTERM.
- ``data_parallel``: the pod's data-parallel ranks, one engine each, behind one HTTP API.
- ``engine``: one DP rank's block allocation, leases, prefill and decode.
- ``handshakes``: decode's prefill engines: one handshake in flight each, restarts retired, evictions.
- ``decode_answer``: what a decode request's ranks answered, as the engine's answer and metrics.
- ``ranks``: the engine's rank processes, free blocks and errors.
- ``rank_worker``: one TP rank as its own process.
- ``rank_entry``: the rank processes' spawn target.
- ``stage_requests``: staged reads between its processes: prefill's rank packs, decode's rank asks.
- ``content``: the bytes a rank "computes", so decode can verify every byte.
- ``http_api``: the engine's HTTP API: health, metrics, prefill, decode.
- ``http_bounds``: its server's bounds on clients: a deadline per request, a cap on open connections.
- ``completions``: its OpenAI-shaped routes, for the router.
- ``pace``: their set speed (a prefill slot, decode's inter-token latency), and the ``vllm:`` series they export.
- ``processes``: starting and stopping local engines.
"""
