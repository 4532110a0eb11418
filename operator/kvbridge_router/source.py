"""Where the router's pool comes from: the DisaggregatedDeployment's status, watched; or a file (no cluster).

The watch is one object's (``fieldSelector=metadata.name=NAME``): a GET gives the status and its
resourceVersion, then a watch from there delivers every change; when the watch ends (the server's timeout, a
dropped connection, 410 Gone) the loop reads again. While the API cannot be reached the router keeps routing to
the last pool it saw -- the pods do not go away with the API server -- and says so in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvbridge_operator.backoff import Backoff
from kvbridge_operator.kube import DEPLOYMENTS, ApiError, KubeClient
from kvbridge_router.pool import Pool

log = logging.getLogger(__name__)
WATCH_SECONDS = 300
RETRY = Backoff(base=0.5, cap=10.0)


async def watch_status(
    client: KubeClient,
    namespace: str,
    name: str,
    publish: Callable[[Pool], None],
    stop: asyncio.Event,
    seen: asyncio.Event | None = None,
) -> None:
    """Publish the pool of ``namespace/name`` on every change of its status until ``stop`` is set; ``seen`` is
    set once the deployment was first read."""
    failures = 0
    while not stop.is_set():
        try:
            current = await client.get(DEPLOYMENTS, namespace, name)
            if current is None:
                log.warning("DisaggregatedDeployment %s/%s not found; looking again", namespace, name)
                publish(Pool())
                await _sleep(stop, RETRY.delay(failures))
                failures += 1
                continue
            version = str(current["metadata"].get("resourceVersion", ""))
            publish(Pool.from_status(current.get("status") or {}, version))
            if seen is not None:
                seen.set()
            failures = 0
            events = client.watch(DEPLOYMENTS, namespace, f"metadata.name={name}", version, WATCH_SECONDS)
            async for event in _until(events, stop):
                obj = event.get("object") or {}
                if event.get("type") == "DELETED":
                    publish(Pool())
                elif event.get("type") in ("ADDED", "MODIFIED"):
                    publish(Pool.from_status(obj.get("status") or {}, str(obj["metadata"].get("resourceVersion"))))
        except (ApiError, aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            log.warning(
                "reading DisaggregatedDeployment %s/%s: %s; routing to the last pool seen meanwhile",
                namespace,
                name,
                exc,
            )
            await _sleep(stop, RETRY.delay(failures))
            failures += 1


async def _until(events: Any, stop: asyncio.Event) -> Any:
    """The watch's events until ``stop`` is set (a watch can sit idle for minutes)."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while True:
            following = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if following not in done:
                following.cancel()  # the watch request is cancelled with it; then the generator can close
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await following
                await events.aclose()
                return
            try:
                yield following.result()
            except StopAsyncIteration:
                return
    finally:
        stopping.cancel()


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


def read_status_file(path: Path) -> Pool:
    """A pool from a file holding a DisaggregatedDeployment (``kubectl get dd NAME -o yaml``) or its status."""
    try:
        loaded = (
            yaml.safe_load(path.read_text(encoding="utf-8"))
            if path.suffix in (".yaml", ".yml")
            else json.loads(path.read_text(encoding="utf-8"))
        )
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a DisaggregatedDeployment or its status, a mapping")
    return Pool.from_status(loaded.get("status", loaded))


async def follow_file(path: Path, publish: Callable[[Pool], None], stop: asyncio.Event, every: float = 1.0) -> None:
    """Publish the file's pool, again whenever it changes."""
    last = -1.0
    while not stop.is_set():
        try:
            mtime = path.stat().st_mtime
            if mtime != last:
                publish(read_status_file(path))
                last = mtime
        except (OSError, ValueError) as exc:
            log.warning("%s; routing to the last pool read", exc)
        await _sleep(stop, every)
