"""Staged reads through engine processes (docs/protocol.md §4d): decode's ranks ask prefill's side channel to stage
each request (``KVBRIDGE_STAGING_MODE=staged`` forces it where the cost model would pick either), prefill's rank
packs it, decode READs and scatters, and every byte is verified; prefill frees the blocks and the staged bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge_agent.core import Role
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_agent.transfer.staging import STAGING_MIB_VARIABLE, STAGING_MODE_VARIABLE
from kvbridge_sim.support import wait_until

from .test_engines import decode, env, prefill

STAGED = {STAGING_MODE_VARIABLE: "staged", STAGING_MIB_VARIABLE: "8"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    keys_dir: Path = tmp_path_factory.mktemp("staged") / "keys"
    generate_keys(keys_dir)
    started: list[EngineProcess] = []
    try:
        started.append(start_engine(env(Role.PREFILL, "sp1", keys_dir), extra_env=STAGED))
        started.append(start_engine(env(Role.DECODE, "sd1", keys_dir), extra_env=STAGED))
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def test_a_tp_2_to_1_pair_reads_staged_and_verifies_every_byte(engines: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = engines
    for index, (tokens, hit) in enumerate([(16, 0), (100, 0), (100, 3), (250, 1)]):
        for attempt in range(3):  # the first read meets prefill (handshake) within the 3 s lease of busy cores
            params = prefill(p, f"staged-{index}-{attempt}", tokens)
            status, body = decode(d, f"d-staged-{index}-{attempt}", params, hit)
            if status == 200:
                break
        assert status == 200, body
        assert body["verified"] is True
        assert body["mode"] == "staged", body
    wait_until(lambda: not p.get("/v1/held")["held"], 5, "prefill freed every request")
