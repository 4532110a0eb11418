"""Data-parallel engines through kvbridge's connector: every prefill DP rank read by every decode DP rank.

vLLM runs one engine core per data-parallel rank (``parallel_config.data_parallel_index``), each with its own KV
cache; kvbridge's connector makes each rank its own transfer peer — engine id ``<pod>_dp<index>``, side channel on
the base port + index — as vLLM's NixlConnector does. Here a prefill engine of DP 2 and a decode engine of DP 3
(vLLM's connector API, both halves per rank, real NIXL on host memory, verification ``All``, vLLM's LBHNC views
from its own allocator): a request prefilled on each prefill rank is loaded by each decode rank, six transfers,
every byte checked where decode's vLLM reads it, each from the peer the parameters name on its own port.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from kvbridge_sim.support import free_port
from tests.physical_kv import check_bytes, fill

from .test_gpu_layouts import DECODE_BLOCKS, MODEL, PREFILL_BLOCKS, TIMEOUT, TOKENS, Side, allocate, blocks_of, request

PREFILL_DP, DECODE_DP = 2, 3
SIDE = Side(KVCacheLayout.LBHNC)


def consecutive_ports(count: int) -> int:
    """A base port with ``count`` free ports from it (the DP ranks listen on base + index)."""
    for _ in range(50):
        base = free_port()
        sockets = []
        try:
            for offset in range(count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def settings(role: Role, index: int, base_port: int) -> ConnectorSettings:
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-pod",
        model=MODEL,
        prefill=RoleSettings(block_size=SIDE.block, tensor_parallel_size=1, data_parallel_size=PREFILL_DP),
        decode=RoleSettings(block_size=SIDE.block, tensor_parallel_size=1, data_parallel_size=DECODE_DP),
        transfer={"verification": "All", "sideChannelPort": base_port},
        side_channel_host="127.0.0.1",
    )
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_producer" if role is Role.PREFILL else "kv_consumer", kv_buffer_device="cuda"
        ),
        cache_config=SimpleNamespace(block_size=SIDE.block),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=index),
    )
    return ConnectorSettings.from_vllm(config, render_environment(env), cpu_build=False)


class Rank:
    """One DP rank of an engine: its scheduler, its one TP worker and the views of its cache."""

    def __init__(self, role: Role, index: int, base_port: int, opened: list[Any]) -> None:
        self.scheduler = ConnectorScheduler(settings(role, index, base_port))
        opened.append(self.scheduler)
        self.worker = ConnectorWorker(self.scheduler.settings, 0, f"inc-{role.value}-{index}")
        opened.append(self.worker)
        self.views = allocate(SIDE.layout)
        if role is Role.PREFILL:  # each DP rank its own bytes: a read from the wrong peer shows
            fill(self.views, SIDE, 0)
            for view in self.views.values():
                view.view(torch.int16).add_(101 * index)
        self.worker.register_kv_caches(self.views, SIDE.layout.name)
        handshake = self.worker.get_handshake_metadata()
        if role is Role.PREFILL:
            assert handshake is not None
            self.scheduler.set_xfer_handshake_metadata({0: handshake})


def test_every_prefill_dp_rank_is_read_by_every_decode_dp_rank(closing: list[Any]) -> None:
    prefill_base, decode_base = consecutive_ports(PREFILL_DP), consecutive_ports(DECODE_DP)
    prefills = [Rank(Role.PREFILL, p, prefill_base, closing) for p in range(PREFILL_DP)]
    decodes = [Rank(Role.DECODE, d, decode_base, closing) for d in range(DECODE_DP)]
    assert [r.scheduler.settings.environment.engine_id for r in prefills] == ["prefill-pod_dp0", "prefill-pod_dp1"]
    for p, prefill in enumerate(prefills):
        for d, decode in enumerate(decodes):
            # prefill rank p computes a prompt and offers it, digested (verification All)
            done, params = prefill.scheduler.request_finished(
                request(f"p{p}-d{d}", {"do_remote_decode": True}), (PREFILL_BLOCKS,)
            )
            assert done is True
            assert params is not None
            ours = params["kvbridge"]
            assert (ours["remoteEngineId"], ours["remotePort"]) == (f"prefill-pod_dp{p}", prefill_base + p)
            meta = prefill.scheduler.build_connector_meta()
            prefill.worker.start_load_kv(meta)
            prefill.scheduler.take_digests(prefill.worker.stats.take())
            # decode rank d loads it into its own blocks
            wanted = request(f"d{d}-p{p}", params)
            assert decode.scheduler.get_num_new_matched_tokens(wanted, 0) == (TOKENS, True)
            decode.scheduler.update_state_after_alloc(wanted, blocks_of(DECODE_BLOCKS), TOKENS)
            decode.worker.start_load_kv(decode.scheduler.build_connector_meta())
            deadline = time.monotonic() + TIMEOUT
            received: set[str] = set()
            while f"d{d}-p{p}" not in received:
                assert time.monotonic() < deadline, f"prefill DP rank {p} -> decode DP rank {d} did not finish"
                prefill.worker.get_finished(set())
                received |= decode.worker.get_finished(set())[1] or set()
                time.sleep(0.002)
            assert decode.worker.get_block_ids_with_load_errors() == set(), (p, d)
            check_bytes(SIDE, SIDE, [prefill.views], [decode.views], PREFILL_BLOCKS, DECODE_BLOCKS)
            for view in decode.views.values():  # the next prefill rank's bytes must arrive afresh
                view.zero_()
    for d, decode in enumerate(decodes):  # one peer per prefill DP rank, each met on its own port
        assert decode.worker.decode is not None
        assert sorted(decode.worker.decode.peers) == ["prefill-pod_dp0", "prefill-pod_dp1"], d
    # parameters of prefill DP rank 0 crossed with rank 1's side channel: refused before a byte is read, although
    # decode knows rank 0's incarnation (the side channel of an incarnation does not move)
    prefill, decode = prefills[0], decodes[0]
    done, params = prefill.scheduler.request_finished(request("crossed", {"do_remote_decode": True}), (PREFILL_BLOCKS,))
    assert params is not None
    prefill.worker.start_load_kv(prefill.scheduler.build_connector_meta())
    prefill.scheduler.take_digests(prefill.worker.stats.take())
    params["kvbridge"]["remotePort"] = prefill_base + 1
    wanted = request("d-crossed", params)
    assert decode.scheduler.get_num_new_matched_tokens(wanted, 0) == (TOKENS, True)
    decode.scheduler.update_state_after_alloc(wanted, blocks_of(DECODE_BLOCKS), TOKENS)
    decode.worker.start_load_kv(decode.scheduler.build_connector_meta())
    deadline, received = time.monotonic() + TIMEOUT, set()
    while "d-crossed" not in received:
        assert time.monotonic() < deadline, "the crossed request neither failed nor finished"
        received |= decode.worker.get_finished(set())[1] or set()
        time.sleep(0.002)
    assert decode.worker.get_block_ids_with_load_errors() == set(DECODE_BLOCKS)
    assert all(not view.any() for view in decode.views.values())  # nothing was read
