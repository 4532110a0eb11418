"""``kubectl logs`` against the local cluster: a pod's container log as the local kubelet keeps it (one file for
the running container, one for the one before its last restart), served as the API server serves
``pods/{name}/log``: plain text, ``tailLines``, ``previous`` and ``follow`` (until the container stops or the client
goes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp.web
import kmock

#: how often a followed log is read again
FOLLOW_INTERVAL_SECONDS = 0.25


@dataclass(frozen=True)
class PodLog:
    """Where one pod's container logs are: the running container's, the previous one's (``None`` before a
    restart), and whether the container still runs (a followed log ends when it stops)."""

    current: Path
    previous: Path | None
    running: Callable[[], bool]


#: ``(namespace, pod) -> PodLog``, or ``None`` for a pod the local kubelet does not run
LogSource = Callable[[str, str], PodLog | None]


def _flag(params: Mapping[str, object], name: str) -> bool:
    return str(params.get(name, "false")).lower() in ("true", "1")


def _tail(data: bytes, params: Mapping[str, object]) -> bytes:
    lines = str(params.get("tailLines", ""))
    if not lines.isdigit():
        return data
    kept = data.splitlines(keepends=True)[-int(lines) :] if int(lines) else []
    return b"".join(kept)


async def serve(
    raw: aiohttp.web.BaseRequest, params: Mapping[str, object], pod: str, log: PodLog | None
) -> aiohttp.web.StreamResponse:
    """The log of ``pod``'s container (``log``: where the kubelet keeps it), as Kubernetes words its refusals."""
    if log is None:
        raise kmock.KubernetesError(
            status=400, reason="BadRequest", message=f'container "engine" in pod "{pod}" is waiting to start'
        )
    previous = _flag(params, "previous")
    path = log.previous if previous else log.current
    if path is None or not path.exists():
        if previous:
            message = f'previous terminated container "engine" in pod "{pod}" not found'
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=message)
        return aiohttp.web.Response(body=b"", content_type="text/plain")
    data = path.read_bytes()
    if previous or not _flag(params, "follow"):
        return aiohttp.web.Response(body=_tail(data, params), content_type="text/plain")
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
    await response.prepare(raw)
    offset = len(data)
    with contextlib.suppress(ConnectionResetError, ConnectionError):
        await response.write(_tail(data, params))
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_SECONDS)
            with path.open("rb") as handle:
                handle.seek(offset)
                more = handle.read()
            offset += len(more)
            if more:
                await response.write(more)
            elif not log.running():
                break
        await response.write_eof()
    return response
