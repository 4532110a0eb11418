"""The router's pool follows the deployment's status through a real watch on the emulated API, and a file."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_operator.kube import DEPLOYMENTS, KubeClient
from kvbridge_router.pool import Pool
from kvbridge_router.source import follow_file, read_status_file, watch_status
from kvbridge_sim.local_api import emulated_api
from kvbridge_sim.support import until

ROOT = Path(__file__).resolve().parents[2]


def status(*prefill: str) -> dict[str, Any]:
    return {
        "prefill": {"endpoints": [{"pod": p, "ip": "10.0.0.1", "httpPort": 8000, "pairing": "k"} for p in prefill]},
        "decode": {"endpoints": [{"pod": "d-0", "ip": "10.0.0.9", "httpPort": 8000, "pairing": "k"}]},
    }


@pytest.fixture
async def api() -> AsyncIterator[KubeClient]:
    async with emulated_api(user_agent="kvbridge-router") as (_, _, client):
        yield client


async def test_the_pool_follows_status_changes_and_deletion(api: KubeClient) -> None:
    import yaml

    document = yaml.safe_load((ROOT / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text())
    seen: list[Pool] = []
    stop, first = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(watch_status(api, "default", "llama3-8b", seen.append, stop, first))
    await asyncio.sleep(0.3)
    assert seen
    assert seen[-1].problem()  # not there yet: an empty pool, and it keeps looking
    await api.create(DEPLOYMENTS, "default", document)
    await api.patch(DEPLOYMENTS, "default", "llama3-8b", {"status": status("p-0")}, "status")
    await until(lambda: [t.pod for t in seen[-1].prefill] == ["p-0"], 10, "the pool of p-0", interval=0.05)
    await api.patch(DEPLOYMENTS, "default", "llama3-8b", {"status": status("p-0", "p-1")}, "status")
    await until(lambda: [t.pod for t in seen[-1].prefill] == ["p-0", "p-1"], 10, "the pool of p-0, p-1", interval=0.05)
    assert first.is_set()
    await api.delete(DEPLOYMENTS, "default", "llama3-8b")
    await until(lambda: seen[-1].prefill == (), 10, "an empty pool after the deletion", interval=0.05)
    stop.set()
    await asyncio.wait_for(task, timeout=5)  # stops promptly, even inside a watch


async def test_a_status_file_is_read_and_reread(tmp_path: Path) -> None:
    path = tmp_path / "dd.json"
    path.write_text(json.dumps({"status": status("p-0")}))
    assert [t.pod for t in read_status_file(path).prefill] == ["p-0"]
    seen: list[Pool] = []
    stop = asyncio.Event()
    task = asyncio.create_task(follow_file(path, seen.append, stop, every=0.05))
    await until(lambda: bool(seen), 10, "the file's first pool", interval=0.05)
    await asyncio.sleep(0.05)
    path.write_text(json.dumps(status("p-0", "p-1")))  # a bare status works too
    os.utime(path, (1, 1))  # a new mtime even within the file system's timestamp granularity
    await until(lambda: len(seen[-1].prefill) == 2, 10, "the reread file's two prefill pods", interval=0.05)
    path.write_text("{broken")
    os.utime(path, (2, 2))
    await asyncio.sleep(0.2)
    assert len(seen[-1].prefill) == 2  # a broken file keeps the last pool
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a DisaggregatedDeployment"):
        read_status_file(tmp_path / "list.json")
