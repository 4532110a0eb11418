"""What every engine shares to move KV caches: the data path and the side channel.

Reading order:
- ``allocations``: the allocations and physical layout behind an engine's strided KV views.
- ``kv_cache``: attach and register a rank's KV tensors, or views by their layout.
- ``kv_view``: a cache read logically.
- ``transport``: NIXL: agents, prepped descriptor lists, READs, notifications.
- ``descriptors``: NIXL descriptor rows for a rank's regions.
- ``prefill_rank``: the prefill side of one rank: offers in the wire format, notifications counted.
- ``decode_rank``: the decode side of one rank: peers, READs, completion, conversions.
- ``reads``: what a decode rank reads by and reports: a peer, a request's result, block ids to descriptor ids.
- ``peer_lists``: a decode rank's prepped lists for one prefill engine, and both sides' segments of each read.
- ``staging``: staging buffers and the indexed copies of staged reads (pack, scatter) on the cache's device.
- ``prefill_staging``: a prefill rank's staging buffer: stage requests packed on request or when offered.
- ``staged_reads``: a decode rank's staged reads: ask, READ a few large descriptors, scatter.
- ``stage_asks``: a decode rank's stage exchanges, on the thread that starts a read or off it, posted later.
- ``cost_model``: direct or staged: the device's per-descriptor cost and copy rates, measured at start.
- ``observed_costs``: that model corrected by completed reads (bounded, per path), and probes of the path not taken.
- ``relayout``: block-size and layout conversions in place.
- ``host_buffer``: a host mirror of the cache, for nodes without GPUDirect RDMA (``kv_buffer_device: cpu``).
- ``side_channel``: the authenticated handshake (ZeroMQ).
- ``peers``: known remote engines and whether a lease still holds.
- ``keys``: the side channel's CURVE keys.
- ``digest``: the transfer digest on the cache's own device.
- ``digest_kernel``: its one pass over a CPU cache (numba).
- ``metrics``: one engine's Prometheus metrics.
- ``background``: kvbridge's own threads in an engine, named for the OS.
"""
