"""What every engine shares to move KV caches: the data path and the side channel.

Reading order: ``allocations`` (the allocations and physical layout behind an engine's strided KV views),
``kv_cache`` (attach and register a rank's KV tensors, or views by their layout), ``kv_view`` (a cache read
logically), ``transport`` (NIXL: agents, prepped descriptor lists, READs, notifications), ``descriptors``,
``prefill_rank`` and ``decode_rank`` (one rank's side of a transfer, with leases), ``relayout`` (block-size and
layout conversions), ``side_channel`` and ``peers`` (the authenticated handshake and known remote engines), ``keys``
(CURVE keys), ``metrics``.
"""
