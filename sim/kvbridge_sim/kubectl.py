"""The real ``kubectl`` against the emulated cluster: a kubeconfig for it, and the cluster (API, operator and the
StatefulSet controller stand-in) on a thread of its own, so that synchronous callers — the doc-example tests, a
shell — can run kubectl while it serves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from kvbridge_sim.cluster import StatefulSetController, cluster

#: the kubectl binary, or None where none is installed (the tests that need it skip, saying so)
KUBECTL = shutil.which("kubectl")


def kubeconfig(url: str, namespace: str = "default") -> str:
    """A kubeconfig whose current context is the emulated API at ``url`` (plain HTTP, a token it does not check)."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f'clusters: [{{name: emulated, cluster: {{server: "{url}"}}}}]\n'
        "users: [{name: tester, user: {token: emulated}}]\n"
        f"contexts: [{{name: emulated, context: {{cluster: emulated, user: tester, namespace: {namespace}}}}}]\n"
        "current-context: emulated\n"
    )


@contextlib.contextmanager
def background_cluster(start_timeout: float = 30.0) -> Iterator[Path]:
    """Run the emulated cluster with the operator and the StatefulSet controller stand-in on a thread; yields the
    path of a kubeconfig for it. Everything stops (within a timeout) on exit."""
    ready = threading.Event()
    failed: list[BaseException] = []
    loops: list[asyncio.AbstractEventLoop] = []
    stops: list[asyncio.Event] = []
    urls: list[str] = []

    async def serve() -> None:
        stop = asyncio.Event()
        loops.append(asyncio.get_running_loop())
        stops.append(stop)
        async with cluster() as c:
            urls.append(c.url)
            controller = asyncio.create_task(StatefulSetController(c).run(stop))
            ready.set()
            await stop.wait()
            await controller

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # pragma: no cover - surfaced to the caller below
            failed.append(exc)
            ready.set()

    thread = threading.Thread(target=main, name="emulated-cluster", daemon=True)
    thread.start()
    if not ready.wait(start_timeout) or failed:
        raise RuntimeError(f"the emulated cluster did not start: {failed[0] if failed else 'timed out'}")
    with tempfile.TemporaryDirectory(prefix="kvbridge-kubectl-") as folder:
        path = Path(folder) / "kubeconfig"
        path.write_text(kubeconfig(urls[0]))
        try:
            yield path
        finally:
            loops[0].call_soon_threadsafe(stops[0].set)
            thread.join(60)


async def run(config: Path, command: str, *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """A shell ``command`` (``kubectl ...``, pipes allowed) with ``KUBECONFIG`` pointing at ``config``, run without
    blocking the event loop the emulated API serves on; killed after ``timeout``."""
    process = await asyncio.create_subprocess_shell(
        command, env={**os.environ, "KUBECONFIG": str(config)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode or 0, out.decode(), err.decode())
