"""Watches of the emulated API: subscribed before the snapshot (nothing lost in between), from a
``resourceVersion`` or the current objects, within ``timeoutSeconds``, through label and field selectors, streamed
one JSON event a line as Kubernetes does (as Tables for ``kubectl get -w``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import aiohttp.web
import kmock
from kmock._internal import rendering

from kvbridge_operator.api.objects import Obj
from kvbridge_sim import tables
from kvbridge_sim.selectors import event_wanted

if TYPE_CHECKING:
    from kvbridge_sim.apiserver import RealisticKubernetes


async def stream(api: RealisticKubernetes, request: rendering.Request) -> aiohttp.web.StreamResponse:
    """A watch as Kubernetes streams it: one JSON event a line (as Tables when asked), until it ends."""
    raw = request._raw_request
    if raw is None:  # pragma: no cover - only synthetic requests lack it
        raise kmock.KubernetesError(status=500, reason="InternalError", message="no raw request")
    events = watch_events(api, request)
    await anext(events)  # subscribed and the backlog is taken: safe to start the response
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(raw)
    as_table = tables.wants_table(str(request.headers.get("Accept", "")))
    try:
        async for event in events:
            if as_table:
                rv = event["object"]["metadata"].get("resourceVersion", "")
                event = {
                    "type": event["type"],
                    "object": tables.for_request(api._info(request), request.params, [event["object"]], rv),
                }
            await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
    except (ConnectionError, RuntimeError):  # the client went away
        pass
    finally:
        await events.aclose()
    return response


async def watch_events(api: RealisticKubernetes, request: rendering.Request) -> AsyncGenerator[Any, None]:
    """A watch's events: first a marker once it is subscribed and has its backlog, then the backlog and what
    follows (since ``resourceVersion``, within ``timeoutSeconds``, through its selectors)."""
    api._info(request)
    gvp = api._gvp(request)
    queue: asyncio.Queue[tuple[int, Obj]] = asyncio.Queue()
    since = request.params.get("resourceVersion")
    timeout = float(request.params.get("timeoutSeconds") or 3600)
    async with api._lock:  # subscribe before the snapshot: nothing is lost in between
        api.watchers.append((gvp, queue))
        if since and since != "0":
            backlog = [(rv, event) for rv, g, event in api.history if g == gvp and rv > int(since)]
        else:
            backlog = [(api.revision, {"type": "ADDED", "object": obj}) for obj in api._matching(request)]
        last = int(since) if since and since != "0" else api.revision
    yield b""
    deadline = asyncio.get_running_loop().time() + timeout
    labels, fields = request.params.get("labelSelector", ""), request.params.get("fieldSelector", "")
    try:
        for _rv, event in backlog:
            if event_wanted(request.namespace, event, labels, fields):
                yield event
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            try:
                rv, event = await asyncio.wait_for(queue.get(), timeout=remaining)
            except TimeoutError:
                return
            if rv > last and event_wanted(request.namespace, event, labels, fields):
                last = rv
                yield event
    finally:
        api.watchers.remove((gvp, queue))
