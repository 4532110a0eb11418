"""A real Prometheus server for the local cluster (Debian's ``prometheus``), for the planner's tests and benchmarks.

It scrapes what the caller names, every ``scrape_seconds``: the pods the local kubelet runs, labelled as the chart's
PodMonitor labels them (``namespace``, ``deployment``, ``role``, ``pod``), the router (``component="router"``) and
the operator (``component="operator"``). The targets live in a file Prometheus watches (file-based service
discovery, ``file_sd_configs``): :meth:`LocalPrometheus.set_targets` rewrites it as pods come and go, as a PodMonitor
follows a role's pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp

from kvbridge_operator.api.names import LABEL_ROLE
from kvbridge_sim.support import free_port, until

#: Debian's package (``apt-get install prometheus``; ``make setup`` installs it as root)
PROMETHEUS = shutil.which("prometheus")
#: how often the targets file is read again (Prometheus' file discovery also watches it)
REFRESH = "5s"


@dataclass(frozen=True, slots=True)
class Target:
    """One address to scrape (``host:port``, ``/metrics``) and the labels its series get."""

    address: str
    labels: tuple[tuple[str, str], ...]


def pod_targets(runner: Any, namespace: str, deployment: str) -> list[Target]:
    """The deployment's engine pods the local kubelet runs (terminating ones too: they serve while they drain)."""
    found = []
    for (pod_namespace, name), pod in sorted(runner.pods.items()):
        labels = ((pod.template.get("metadata") or {}).get("labels")) or {}
        role = labels.get(LABEL_ROLE, "")
        if pod_namespace != namespace or pod.deployment != deployment or not role:
            continue
        found.append(
            Target(
                f"{pod.ip}:{pod.spec.http_port}",
                (("namespace", namespace), ("deployment", deployment), ("role", role), ("pod", name)),
            )
        )
    return found


class LocalPrometheus:
    """``prometheus`` as a process of this one, its data in ``folder``; :attr:`url` once :meth:`start` returned."""

    def __init__(self, folder: Path, scrape_seconds: float = 1.0) -> None:
        if PROMETHEUS is None:
            raise FileNotFoundError("no prometheus binary (apt-get install prometheus; make setup does as root)")
        self.folder = folder
        self.scrape_seconds = scrape_seconds
        self.targets_file = folder / "targets.json"
        self.url = ""
        self._written: list[Target] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def _config(self) -> str:
        every = f"{self.scrape_seconds:g}s"
        return (
            f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n  evaluation_interval: {every}\n"
            "scrape_configs:\n  - job_name: local\n    file_sd_configs:\n"
            f"      - files: ['{self.targets_file}']\n        refresh_interval: {REFRESH}\n"
        )

    def set_targets(self, targets: list[Target]) -> None:
        """Scrape these from now on (the file is replaced at once, so Prometheus never reads half of it)."""
        if targets == self._written:
            return
        groups = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
        staged = self.targets_file.with_suffix(".tmp")
        staged.write_text(json.dumps(groups))
        os.replace(staged, self.targets_file)
        self._written = list(targets)

    async def start(self, timeout: float = 60) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._written is None:
            self.set_targets([])
        (self.folder / "prometheus.yml").write_text(self._config())
        port = free_port()
        self._log = (self.folder / "prometheus.log").open("wb")
        self._process = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={self.folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:

            async def ready() -> bool:
                if self._process is not None and self._process.poll() is not None:
                    raise RuntimeError(f"prometheus exited ({self._process.returncode}): see {self.folder}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.url}/-/ready") as answer:
                        return answer.status == 200
                return False

            await until(ready, timeout, "Prometheus ready", interval=0.2)
        return self.url

    async def query(self, session: aiohttp.ClientSession, promql: str) -> float | None:
        """One instant query's single value (None: no series, or no answer)."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
            async with session.get(f"{self.url}/api/v1/query", params={"query": promql}) as answer:
                result = (await answer.json())["data"]["result"]
            return float(result[0]["value"][1]) if result else None
        return None

    async def close(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                await asyncio.to_thread(self._process.wait, 20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                await asyncio.to_thread(self._process.wait, 10)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
