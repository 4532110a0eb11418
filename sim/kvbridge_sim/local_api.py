"""The emulated API on a local port: the server (which closes idle client connections on demand, as a server's idle
timeout would), :func:`emulated_api` with kvbridge's CRDs installed, and stopping an operator that runs beside it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import kmock

from kvbridge_operator.api.crd import crds
from kvbridge_operator.kube import USER_AGENT, KubeClient, Resource
from kvbridge_sim.apiserver import RealisticKubernetes

#: the emulator's HTTP servers by URL, for :func:`close_idle_connections`
_SERVERS: dict[str, _Server] = {}


class _Server(aiohttp.test_utils.RawTestServer):
    """kmock's test server, which can close the client connections that sit idle between requests."""

    _url = ""

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        await super().start_server(loop, **kwargs)
        self._url = str(self.make_url("")).rstrip("/")
        _SERVERS[self._url] = self

    async def close(self) -> None:
        _SERVERS.pop(self._url, None)
        await super().close()

    def close_idle_connections(self) -> int:
        runner = self.runner
        if runner is None or runner.server is None:
            return 0
        idle = [c for c in runner.server.connections if _idle(c)]
        for connection in idle:  # the socket closed now, as a server's idle timeout does: the client sees it
            connection.force_close()
        return len(idle)


def _idle(connection: aiohttp.web.RequestHandler) -> bool:
    """Whether a connection waits for its next request with none received (aiohttp's own state, as its keep-alive
    check reads it; unknown counts as busy). A request still in the kernel's buffer cannot be seen: closing is for
    when no client sends, as while Kopf stops."""
    waiter = getattr(connection, "_waiter", None)
    return (
        waiter is not None
        and not waiter.done()
        and getattr(connection, "_current_request", 1) is None
        and not getattr(connection, "_messages", True)
    )


def close_idle_connections(url: str) -> int:
    """Close the keep-alive connections to the emulator at ``url`` that wait for their next request, as a server
    does with idle connections; how many."""
    server = _SERVERS.get(url.rstrip("/"))
    return 0 if server is None else server.close_idle_connections()


async def stop_operator_beside(url: str, operator: asyncio.Task[None], stop: asyncio.Event, timeout: float) -> None:
    """Stop an operator that runs in this event loop beside the emulator at ``url``, within ``timeout`` seconds.
    Kopf, stopping, waits up to 5 s for every task started after it, and the emulator's handler of an idle
    connection from the operator's or anybody's client is one: every operator test and demo paid those 5 s at its
    end. While Kopf stops, idle connections are closed, and it stops in a few hundred milliseconds; past
    ``timeout`` it is cancelled and TimeoutError raised."""
    stop.set()
    try:
        async with asyncio.timeout(timeout):
            while not operator.done():
                close_idle_connections(url)
                await asyncio.wait([operator], timeout=0.05)
            await operator
    except TimeoutError:  # a hang is a failure, but never leave the task behind
        operator.cancel()
        with contextlib.suppress(BaseException):
            await operator
        raise


#: where the CRDs are created
CRDS = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)


@contextlib.asynccontextmanager
async def emulated_api(
    *, token: str | None = None, user_agent: str = USER_AGENT
) -> AsyncIterator[tuple[RealisticKubernetes, str, KubeClient]]:
    """The emulated API server on a local port with kvbridge's CRDs installed: the emulator, its URL and a client of
    it (``user_agent`` tells its calls apart from the operator's); all closed on exit."""
    async with RealisticKubernetes() as api, kmock.Server(api, server_cls=_Server) as server:
        url = str(server.url).rstrip("/")
        client = KubeClient.for_url(url, token=token, user_agent=user_agent)
        try:
            for definition in crds():
                await client.create(CRDS, "", definition)
            yield api, url, client
        finally:
            await client.close()
