"""Two router replicas — real ``kvbridge-router`` processes reading one status and reporting to each other — in
front of the same engine stand-ins, one killed (SIGKILL) under load and started again: the other replica's clients
see no failure, the killed one's requests in flight fail at once (no hang), and the restarted replica serves again
within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from kvbridge_sim.support import free_port

from .test_proxy import FakeEngine

CLIENTS_PER_REPLICA = 4
#: each decode call takes this long, so that requests are in flight when the replica is killed
DECODE_SECONDS = 0.3
#: a client's bound on one request: a request that hangs fails the test by taking it
CLIENT_TIMEOUT = 10.0
#: how soon the restarted replica, once healthy, must have served a request begun after that
SERVE_AGAIN_SECONDS = 8.0


@dataclass(frozen=True)
class Outcome:
    replica: str
    began: float
    ended: float
    status: int  # -1: the connection failed


class Replica:
    """One ``kvbridge-router`` process on its own port, following the status file."""

    def __init__(self, name: str, status: Path, workdir: Path) -> None:
        self.name, self.status, self.port = name, status, free_port()
        self.log = workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        #: the flags that make it report to the others, as the operator renders them (--peers, --peer-key-file)
        self.peers: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "kvbridge_router", "--status-file", str(self.status)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--decode-timeout", "5", "--replicas", "2"]
        command += self.peers
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    async def healthy(self, session: aiohttp.ClientSession, within: float) -> float:
        """Seconds until its /health is 200 (a pool read and routable)."""
        started = time.monotonic()
        while time.monotonic() - started < within:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with session.get(f"{self.url}/health") as answer:
                    if answer.status == 200:
                        return time.monotonic() - started
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.name} not healthy within {within:g} s: {self.log.read_text()[-2000:]}")


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    found = [FakeEngine("prefill-0"), FakeEngine("prefill-1"), FakeEngine("decode-0", delay=DECODE_SECONDS)]
    for engine in found:
        await engine.start()
    yield found
    for engine in found:
        if engine.server is not None:
            await engine.server.close()


@pytest.fixture
def replicas(engines: list[FakeEngine], tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    status = tmp_path / "status.json"
    pods = {"prefill": engines[:2], "decode": engines[2:]}
    status.write_text(json.dumps({role: {"endpoints": [e.endpoint for e in of]} for role, of in pods.items()}))
    pair = (Replica("router-a", status, tmp_path), Replica("router-b", status, tmp_path))
    key = tmp_path / "peer-key"
    key.write_text("k" * 64)
    for replica in pair:  # each reports to both addresses (its own report comes back and is ignored)
        replica.peers = ["--peers", ",".join(r.url for r in pair), "--peer-key-file", str(key)]
        replica.start()
    try:
        yield pair
    finally:
        for replica in pair:
            replica.stop()


async def client(
    session: aiohttp.ClientSession, replica: Replica, index: int, until: list[float], outcomes: list[Outcome]
) -> None:
    number = 0
    while time.monotonic() < until[0]:
        number += 1
        body = {"model": "m", "prompt": f"client {replica.name} {index} request {number}", "max_tokens": 3}
        began = time.monotonic()
        try:
            async with session.post(f"{replica.url}/v1/completions", json=body) as answer:
                await answer.read()
                status = answer.status
        except (aiohttp.ClientError, ConnectionError):
            status = -1
        outcomes.append(Outcome(replica.name, began, time.monotonic(), status))
        if status == -1:
            await asyncio.sleep(0.05)  # a client's pause before it tries again


async def test_a_replica_killed_under_load_fails_only_its_own_requests_at_once_and_comes_back(
    engines: list[FakeEngine], replicas: tuple[Replica, Replica]
) -> None:
    killed, other = replicas
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for replica in replicas:
            await replica.healthy(session, within=30)
        outcomes: list[Outcome] = []
        planned_end = time.monotonic() + 6
        #: the clients' end: none before the restarted replica has served again (it may be slow to start)
        until = [planned_end + SERVE_AGAIN_SECONDS + 30]
        load = [
            asyncio.create_task(client(session, replica, i, until, outcomes))
            for replica in replicas
            for i in range(CLIENTS_PER_REPLICA)
        ]
        try:
            await asyncio.sleep(2)
            killed_at = time.monotonic()
            await asyncio.to_thread(killed.kill)
            await asyncio.sleep(0.5)
            killed.start()
            back_after = await killed.healthy(session, within=15)
            healthy_at = time.monotonic()

            def served_again() -> list[Outcome]:
                return [o for o in outcomes if o.replica == killed.name and o.began > healthy_at and o.status == 200]

            # the load goes on until the restarted replica has served a request begun after it said it was healthy
            # (within SERVE_AGAIN_SECONDS: a busy machine's first requests are slow), and at least until the planned end
            while not served_again() and time.monotonic() - healthy_at < SERVE_AGAIN_SECONDS:
                await asyncio.sleep(0.05)
        finally:  # the clients stop at the planned end, or now if that has passed (also when the restart failed)
            until[0] = max(planned_end, time.monotonic())
            await asyncio.gather(*load)
    mine = [o for o in outcomes if o.replica == other.name]
    theirs = [o for o in outcomes if o.replica == killed.name]
    assert len(mine) > 20, f"the other replica served only {len(mine)} requests"
    assert all(o.status == 200 for o in mine), [o for o in mine if o.status != 200][:5]
    cut = [o for o in theirs if o.began < killed_at < o.ended]
    assert cut, "no request was in flight at the killed replica"
    assert all(o.status == -1 for o in cut)
    assert max(o.ended for o in cut) - killed_at < 1.0  # failed at once: the connection reset, no hang
    assert max(o.ended - o.began for o in outcomes) < 3 * DECODE_SECONDS + 2  # no request hung anywhere
    assert back_after < 10, f"the restarted replica took {back_after:.1f} s to serve"
    since = [o.status for o in theirs if o.began > healthy_at]
    assert served_again(), (
        f"the restarted replica served no request within {SERVE_AGAIN_SECONDS:g} s of being healthy "
        f"({back_after:.1f} s after its start); statuses since: {since}"
    )
    await asyncio.sleep(0.2)
    assert all(engine.in_flight == 0 for engine in engines)  # the killed replica's calls ended on the engines too
    # the other replica heard the restarted one (a new id) and counts its reports as accepted
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(f"{other.url}/metrics") as answer:
        metrics = await answer.text()
    assert "kvbridge_router_peers 1.0" in metrics
    assert 'kvbridge_router_peer_reports_total{direction="received",outcome="accepted"}' in metrics
