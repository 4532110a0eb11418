"""``kubectl logs`` against the local cluster: a pod's container log as the local kubelet keeps it (one file for
the running container, one for the one before its last restart), served as the API server serves
``pods/{name}/log``: plain text, ``container``, ``tailLines``, ``limitBytes``, ``previous`` and ``follow`` (until the
container stops or the client goes). Not served: ``timestamps``, ``sinceSeconds`` and ``sinceTime`` (the local
kubelet keeps no timestamps); the whole log is answered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp.web
import kmock

from kvbridge_operator.api.names import ENGINE_CONTAINER
from kvbridge_operator.api.objects import Obj

#: how often a followed log is read again
FOLLOW_INTERVAL_SECONDS = 0.25
#: the most of a log's end read for its last lines (a crash report's)
TAIL_BYTES = 64 << 10


@dataclass(frozen=True)
class PodLog:
    """Where one pod's container logs are: the running container's, the previous one's (``None`` before a
    restart), and whether the container still runs (a followed log ends when it stops)."""

    current: Path
    previous: Path | None
    running: Callable[[], bool]


#: ``(namespace, pod) -> PodLog``, or ``None`` for a pod the local kubelet does not run
LogSource = Callable[[str, str], PodLog | None]


def last_lines(path: Path, count: int) -> list[str]:
    """The last ``count`` lines of a log file (of its last :data:`TAIL_BYTES` bytes); none if it is missing."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, 2) - TAIL_BYTES))
            data = handle.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-count:] if count > 0 else []


def _flag(params: Mapping[str, object], name: str) -> bool:
    return str(params.get(name, "false")).lower() in ("true", "1")


def _tail(data: bytes, params: Mapping[str, object]) -> bytes:
    lines = str(params.get("tailLines", ""))
    if not lines.isdigit():
        return data
    kept = data.splitlines(keepends=True)[-int(lines) :] if int(lines) else []
    return b"".join(kept)


def _container(params: Mapping[str, object], pod: Obj) -> str:
    """The container whose log is asked for (``container``, or the pod's only one), refused as Kubernetes words it
    where the pod has no such container or several and none is named."""
    name = pod["metadata"]["name"]
    spec = pod.get("spec") or {}
    names = [str(c.get("name")) for key in ("containers", "initContainers") for c in spec.get(key) or []]
    wanted = str(params.get("container") or "")
    if not wanted:
        if len(spec.get("containers") or []) > 1:
            raise _bad_request(f"a container name must be specified for pod {name}, choose one of: [{' '.join(names)}]")
        return names[0] if names else ENGINE_CONTAINER
    if names and wanted not in names:
        raise _bad_request(f"container {wanted} is not valid for pod {name}")
    return wanted


def _bad_request(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=400, reason="BadRequest", message=message, details={})


def _limited(data: bytes, params: Mapping[str, object]) -> bytes:
    """``limitBytes``: at most that many bytes of the log."""
    limit = str(params.get("limitBytes", ""))
    return data[: int(limit)] if limit.isdigit() else data


async def serve(
    raw: aiohttp.web.BaseRequest, params: Mapping[str, object], pod: Obj, log: PodLog | None
) -> aiohttp.web.StreamResponse:
    """The log of ``pod``'s container (``log``: where the kubelet keeps the engine's), as Kubernetes serves
    ``pods/{name}/log``: ``container``, ``tailLines``, ``limitBytes``, ``previous`` and ``follow``; its refusals
    worded as Kubernetes words them."""
    name, container = pod["metadata"]["name"], _container(params, pod)
    if log is None or container != ENGINE_CONTAINER:  # the local kubelet runs the engine container only
        raise _bad_request(f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
    previous = _flag(params, "previous")
    path = log.previous if previous else log.current
    if path is None or not path.exists():
        if previous:
            raise _bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
        return aiohttp.web.Response(body=b"", content_type="text/plain")
    data = path.read_bytes()
    if previous or not _flag(params, "follow"):
        return aiohttp.web.Response(body=_limited(_tail(data, params), params), content_type="text/plain")
    return await _follow(raw, params, path, data, log)


async def _follow(
    raw: aiohttp.web.BaseRequest, params: Mapping[str, object], path: Path, data: bytes, log: PodLog
) -> aiohttp.web.StreamResponse:
    """``follow``: what the log holds, then what the container writes, until it stops or the client goes."""
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
