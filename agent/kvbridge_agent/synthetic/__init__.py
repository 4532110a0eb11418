"""The synthetic engine worker (``kvbridge-agent serve``): an engine without a model that moves real KV bytes.

Reading order: ``serve`` (the process), ``engine`` (block allocation, handshakes, leases) with ``ranks`` (its rank
processes and errors), ``rank_worker`` and ``rank_entry`` (one TP rank), ``content`` (the bytes a rank "computes",
so decode can verify every byte), ``http_api`` and ``completions`` (its HTTP API, OpenAI-shaped for the router),
``processes`` (starting local engines).
"""
