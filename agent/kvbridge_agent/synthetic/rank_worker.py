"""One TP rank of the agent worker, as its own process.

The engine process sends small control messages over a pipe; the rank owns
its KV cache tensors and its NIXL agent and drives NIXL progress from its
own loop: spinning while its READs are in flight, polling every half
millisecond while offered requests await readers, and every 20 ms when idle.
KV bytes never pass through this pipe.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from kvbridge_agent.core import KVBridgeError, build_plan
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.digest import RequestDigests, from_bytes, to_bytes
from kvbridge_agent.core.handshake import KVTransferParams, RankMetadata
from kvbridge_agent.core.model import Role
from kvbridge_agent.core.stage_requests import StageRequest
from kvbridge_agent.synthetic.content import fill_request, invalid_blocks, scribble
from kvbridge_agent.synthetic.stage_requests import rank_stager
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult, Verify
from kvbridge_agent.transfer.staging import staging_bytes, staging_mode
from kvbridge_agent.transfer.transport import Transport

log = logging.getLogger(__name__)


def rank_device(device: str, dp_index: int, tp_size: int, rank: int, visible: int) -> str:
    """The device of one rank's cache: on GPUs, its own of the pod's ``DP x TP`` (DP rank ``dp_index``'s TP rank
    ``rank``), as vLLM places ranks; ranks share GPUs only where fewer are visible (a test on one GPU)."""
    if device != "cuda" or visible < 1:
        return device
    index = dp_index * tp_size + rank
    if index >= visible:
        log.warning(
            "rank %d of DP rank %d shares a GPU: %d visible, the pod's ranks need more", rank, dp_index, visible
        )
    return f"cuda:{index % visible}"


VERIFY_MISMATCH = "VERIFY_MISMATCH"
IDLE_WAIT = 0.02
WAITING_FOR_READERS = 0.0005


def _result_dict(result: ReadResult) -> dict[str, Any]:
    return {
        "ok": result.ok,
        "code": result.code,
        "message": result.message,
        "invalidBlocks": result.invalid_blocks,
        "bytes": result.bytes,
        "descriptors": result.descriptors,
        "seconds": result.seconds,
        "idsMicroseconds": result.ids_microseconds,
        "makeMicroseconds": result.make_microseconds,
        "postMicroseconds": result.post_microseconds,
        "ownMicroseconds": result.own_microseconds,
        "peerFailed": result.peer_failed,
        "mode": result.mode,
    }


def _visible_gpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def _use_gpu(device: str) -> None:
    import torch

    torch.cuda.set_device(device)


class RankWorker:
    def __init__(self, env: EngineEnvironment, rank: int, incarnation: str, conn: Connection) -> None:
        self.env = env
        self.conn = conn
        own = env.own
        visible = _visible_gpus() if env.device == "cuda" else 0
        device = rank_device(env.device, env.dp_index, own.tensor_parallel_size, rank, visible)
        if device.startswith("cuda:"):  # libraries that use the current device (UCX's CUDA transports) use this one
            _use_gpu(device)
        self.cache = KVCache.allocate(
            env.model, own.block_size, own.kv_layout, own.tensor_parallel_size, rank, env.num_blocks, device
        )
        self.transport = Transport(f"{env.engine_id}.{incarnation}.{rank}", env.transfer.backends)
        self.transport.register(self.cache.tensors)
        self.prefill: PrefillRank | None = None
        self.decode: DecodeRank | None = None
        #: staged reads (docs/protocol.md §4d): a staging buffer per rank, sized from the environment
        staging = staging_bytes(os.environ, sum(t.numel() * t.element_size() for t in self.cache.tensors))
        self.stager = rank_stager(env)
        if env.role is Role.PREFILL:
            plan = build_plan(env.model, env.prefill, env.decode, env.transfer)
            self.prefill = PrefillRank(
                self.cache, self.transport, plan, env.engine_id, incarnation, staging_bytes=staging
            )
        else:
            self.decode = DecodeRank(
                self.cache, self.transport, env.decode, env.transfer, staging_bytes=staging, stager=self.stager
            )
            if self.decode.staging is not None:
                self.decode.staging.mode = staging_mode(os.environ)
        self._reads: dict[str, dict[str, Any]] = {}
        self.running = True

    # -- commands -------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        try:
            reply = getattr(self, f"_op_{op}")(message)
        except KVBridgeError as exc:
            reply = {"ok": False, "code": exc.code, "message": exc.message}
        except Exception as exc:  # a bug must not kill the rank silently
            log.exception("rank command %s failed", op)
            reply = {"ok": False, "code": "INTERNAL_ERROR", "message": f"{type(exc).__name__}: {exc}"}
        if reply is not None and "id" in message:
            self.conn.send({"id": message["id"], **reply})

    def _op_metadata(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.prefill is None:
            return {"ok": False, "code": "WRONG_ROLE", "message": "decode ranks serve no metadata"}
        return {"ok": True, "metadata": self.prefill.metadata().model_dump_json(), "agent": self.transport.metadata()}

    def _op_offer(self, message: dict[str, Any]) -> dict[str, Any]:
        prefill = self.prefill
        if prefill is None:
            return {"ok": False, "code": "WRONG_ROLE", "message": "only prefill ranks offer requests"}
        blocks = list(message["blocks"])
        if self.env.verify:
            fill_request(self.cache, message["request_id"], blocks)  # the synthetic "compute"
        digests = prefill.offer(
            message["request_id"], blocks, int(message.get("digest_tokens", 0)), bytes(message.get("digest_key", b""))
        )
        heads, data = to_bytes(digests)
        return {"ok": True, "digestHeads": heads, "digest": data}

    def _op_stage(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.prefill is None:
            return {"ok": False, "code": "WRONG_ROLE", "message": "only prefill ranks stage requests"}
        request = StageRequest.model_validate_json(message["request"])
        return {"ok": True, "reply": self.prefill.stage(message["request_id"], request).model_dump_json()}

    def _op_forget(self, message: dict[str, Any]) -> None:
        if self.prefill is not None:
            self.prefill.forget(message["request_id"])

    def _op_add_peer(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.decode is None:
            return {"ok": False, "code": "WRONG_ROLE", "message": "only decode ranks add peers"}
        ranks = {
            int(p): (RankMetadata.model_validate_json(meta), agent) for p, (meta, agent) in message["ranks"].items()
        }
        peer = self.decode.add_peer(message["engine_id"], message["incarnation"], ranks)
        return {"ok": True, "descriptorsPerBlock": peer.rank_plan.descriptors_per_block}

    def _op_evict_peer(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.decode is None:
            return {"ok": True, "evicted": False}
        return {"ok": True, "evicted": self.decode.evict_peer(message["engine_id"])}

    def _op_read(self, message: dict[str, Any]) -> dict[str, Any] | None:
        if self.decode is None:
            return {"ok": False, "code": "WRONG_ROLE", "message": "only decode ranks read"}
        params = KVTransferParams.model_validate_json(message["params"])
        blocks, hit = list(message["blocks"]), int(message["hit"])
        if self.env.verify:
            fill_request(self.cache, params.remote_request_id, blocks[:hit])  # the prefix this engine already holds
            scribble(self.cache, blocks[hit:])  # so a missing write cannot pass verification
        request_id = message["request_id"]
        self._reads[request_id] = {"id": message["id"], "params": params, "blocks": blocks}
        self.stager.hosts[params.remote_request_id] = message.get("stage_host", params.remote_host)
        expected = message.get("expected")  # (heads, digest bytes, key): prefill's, when this read is verified
        verify = None
        if expected:
            heads, data, key = expected
            verify = Verify(RequestDigests(bytes(key), from_bytes(heads, data)), blocks, params.num_tokens)
        result = self.decode.start(request_id, params, blocks[hit:], self.env.transfer_timeout_seconds, verify)
        if result is not None:
            self._complete(result)
        return None  # replied when the READs complete

    def _op_stats(self, message: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "openHandles": self.transport.open_handles,
            "pending": self.prefill.pending if self.prefill else [],
            "inFlight": self.decode.in_flight if self.decode else 0,
        }

    def _op_shutdown(self, message: dict[str, Any]) -> dict[str, Any]:
        self.running = False
        return {"ok": True}

    # -- progress -------------------------------------------------------------
    def _complete(self, result: ReadResult) -> None:
        read = self._reads.pop(result.request_id)
        self.stager.hosts.pop(read["params"].remote_request_id, None)
        reply = _result_dict(result)
        reply["verified"] = False
        if result.ok and self.env.verify:
            started = time.perf_counter()
            params: KVTransferParams = read["params"]
            bad = invalid_blocks(self.cache, params.remote_request_id, read["blocks"], params.num_tokens)
            reply["verifySeconds"] = time.perf_counter() - started
            if bad:
                reply.update(
                    ok=False,
                    code=VERIFY_MISMATCH,
                    invalidBlocks=bad,
                    message=f"{len(bad)} block(s) differ from what prefill computed",
                )
            else:
                reply["verified"] = True
        self.conn.send({"id": read["id"], **reply})

    def progress(self) -> float:
        """Drive NIXL; returns how long to wait for the next command."""
        if self.decode is not None:
            for result in self.decode.poll():
                self._complete(result)
            return 0.0 if self.decode.in_flight else IDLE_WAIT
        if self.prefill is None:
            return IDLE_WAIT
        events = self.prefill.poll()
        for request_id in events.completed:
            self.conn.send({"event": "complete", "request_id": request_id})
        if events.unknown or events.malformed:
            self.conn.send({"event": "notifications", "unknown": events.unknown, "malformed": events.malformed})
        return WAITING_FOR_READERS if self.prefill.pending else IDLE_WAIT

    def run(self) -> None:
        wait = IDLE_WAIT
        while self.running:
            if self.conn.poll(wait):
                try:
                    message = self.conn.recv()
                except EOFError:  # the engine process is gone
                    break
                self.handle(message)
            try:
                wait = self.progress()
            except Exception:  # a fault completing one request must not end the rank's loop (and the engine)
                log.exception("rank progress failed")
                wait = IDLE_WAIT

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close()
        self.transport.close()


def rank_main(env_json: str, rank: int, incarnation: str, conn: Connection, log_level: str) -> None:
    """Entry point of a rank process (spawned by the engine)."""
    os.dup2(2, 1)  # the engine's stdout carries only its ready line; libraries here may print
    faulthandler.enable()  # a native fault (NIXL, UCX, torch) leaves its Python stack in the pod's log
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its ranks
    env = EngineEnvironment.model_validate_json(env_json)
    try:
        worker = RankWorker(env, rank, incarnation, conn)
    except KVBridgeError as exc:
        conn.send({"event": "failed", "code": exc.code, "message": exc.message})
        return
    except Exception as exc:
        conn.send({"event": "failed", "code": "INTERNAL_ERROR", "message": f"{type(exc).__name__}: {exc}"})
        return
    conn.send({"event": "ready", "pid": os.getpid()})
    try:
        worker.run()
    finally:
        worker.close()
        conn.close()
