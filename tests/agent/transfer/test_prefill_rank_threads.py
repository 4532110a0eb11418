"""A prefill rank staged from another thread than the one that offers and frees (vLLM's connector: a relay thread
packs, vLLM's step thread offers, polls and forgets): a request freed while its pack is under way leaves no staged
bytes behind (the rank's lock)."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.stage_requests import STAGE_NOT_OFFERED, StageReply

from .harness import model as region_model
from .staged_harness import Side, StagedPair


def test_a_request_forgotten_during_its_pack_keeps_no_staged_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = StagedPair(region_model(), Side(None), Side(None), blocks=16)
    try:
        ((result, _),) = pair.run(40, [1, 4, 6], [2, 3, 5], seed=3, mode="staged").values()
        assert result.ok
        assert result.mode == "staged"
        asked = pair.stage_requests[-1].model_copy(update={"first": 0, "count": 1})  # a range not packed at offer
        rank = pair.prefill[0]
        assert rank.staging is not None
        params = pair.offer(40, [7, 8, 9], seed=4)
        request_id = params.remote_request_id
        packing, pack = threading.Event(), rank.staging._pack

        def slow_pack(*args: object) -> object:
            packing.set()
            time.sleep(0.3)
            return pack(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(rank.staging, "_pack", slow_pack)
        replies: list[StageReply | str] = []

        def stage() -> None:
            try:
                replies.append(rank.stage(request_id, asked))
            except KVBridgeError as exc:
                replies.append(exc.code)

        relay = threading.Thread(target=stage)
        relay.start()
        assert packing.wait(5)
        assert rank.forget(request_id)  # its lease ended, on the engine's thread, while the relay thread packs
        relay.join(5)
        assert len(replies) == 1
        assert request_id not in rank.staging.held  # whatever the pack took went back with the request
        with pytest.raises(KVBridgeError) as gone:
            rank.stage(request_id, asked)
        assert gone.value.code == STAGE_NOT_OFFERED
    finally:
        pair.close()
