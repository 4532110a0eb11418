"""Faults injected into a running prefill engine's KV cache from outside its process: a NIXL agent of its own
that gets the engine's memory layout over the side channel (it needs the deployment's key, as any decode does) and
WRITEs over the first bytes of a request's first block — what a stray writer, a reused block or a bad DMA would do.
For tests of transfer verification (docs/protocol.md §8); nothing in the product writes into another engine."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import numpy as np
import torch

from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.side_channel import SideChannelClient
from kvbridge_agent.transfer.transport import Transport
from kvbridge_sim.support import wait_until

#: the byte written
JUNK = 0x5A


def _ended(transport: Transport, handle: Any) -> bool:
    return transport.state(handle) in ("DONE", "ERR")


def overwrite_prefill_kv(
    params: KVTransferParams, keys: CurveKeys | None, nbytes: int = 64, timeout: float = 10.0
) -> int:
    """Overwrite ``nbytes`` at the start of the request's first block (layer 0, keys) on every prefill rank;
    returns how many ranks were written."""
    ranks = SideChannelClient(params.remote_host, params.remote_port, params.fingerprint, keys, timeout).fetch(
        list(range(params.remote_tp_size))
    )
    junk = torch.full((nbytes,), JUNK, dtype=torch.uint8)
    transport = Transport(f"kv-fault-{uuid.uuid4().hex[:8]}")
    try:
        transport.register([junk])
        local = transport.prep("", np.array([[junk.data_ptr(), nbytes, 0]], dtype=np.int64), "DRAM")
        for meta, agent in ranks.values():
            peer = transport.add_peer(agent)
            block = params.remote_block_ids[0] // (meta.block_size // meta.wire_block_size)
            address = meta.tensor_bases[0] + block * meta.region_block_bytes
            remote = transport.prep(
                peer, np.array([[address, nbytes, meta.device_id]], dtype=np.int64), meta.memory_type.value
            )
            agent_api = transport._agent  # the product only READs; this fault WRITEs
            handle = agent_api.make_prepped_xfer("WRITE", local, [0], remote, [0])
            transport.post(handle)
            wait_until(
                functools.partial(_ended, transport, handle),
                timeout,
                f"the WRITE into {meta.engine_id} rank {meta.tp_rank} to finish",
                interval=0.005,
            )
            if transport.state(handle) == "ERR":
                raise RuntimeError(f"the WRITE into {meta.engine_id} rank {meta.tp_rank} failed")
            transport.release(handle)
        return len(ranks)
    finally:
        transport.close()
