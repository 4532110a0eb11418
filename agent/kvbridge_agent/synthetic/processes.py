"""Starting and stopping local ``kvbridge-agent serve`` processes (loopback, tests, the demo's runner)."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.contract import EngineEnvironment, render_environment

START_TIMEOUT = 240.0
#: the pid of the engine's starter: the engine stops (draining, as on SIGTERM) once it is no longer its parent, even
#: if it was killed; :func:`start_engine` sets it, so that no engine a test or benchmark started outlives it
EXIT_WITH_PARENT = "KVBRIDGE_EXIT_WITH_PARENT"


class ProcessError(KVBridgeError):
    code = "ENGINE_PROCESS_FAILED"


@dataclass
class EngineProcess:
    """A running engine: its process, the ports it bound and the rank pids it reported."""

    env: EngineEnvironment
    process: subprocess.Popen[bytes]
    log_path: str
    ready: dict[str, Any] = field(default_factory=dict)

    def log_tail(self, size: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(max(0, os.path.getsize(self.log_path) - size))
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ready['httpPort']}"

    @property
    def pids(self) -> list[int]:
        return [self.process.pid, *self.ready.get("rankPids", [])]

    def post(
        self, path: str, body: dict[str, Any], timeout: float = 120.0, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """POST JSON; returns (status, body) for success and error statuses alike."""
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def get(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the engine's Prometheus samples named ``name`` that carry ``labels``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            sample = line.split("{", 1)[0].split(" ", 1)[0]
            if sample == name and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def handshake_seconds(self) -> float:
        """Mean handshake time from the kvbridge_handshake_seconds histogram (0 before any)."""
        count = self.metric("kvbridge_handshake_seconds_count")
        return self.metric("kvbridge_handshake_seconds_sum") / count if count else 0.0

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL the engine and any rank it left behind."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for pid in self.ready.get("rankPids", []):
            _kill_if_alive(pid)
        if self.process.stdout is not None:
            self.process.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)

    def kill(self) -> None:
        """Simulate a crash: SIGKILL the engine and its ranks at once."""
        for pid in self.pids:
            _kill_if_alive(pid)
        self.process.wait(timeout=10)


def _kill_if_alive(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start_engine(
    env: EngineEnvironment,
    *,
    log_level: str = "WARNING",
    extra_env: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT,
) -> EngineProcess:
    """Start ``kvbridge-agent serve`` for ``env`` and wait for its ready line."""
    # its starter dying (a killed test run, a crashed pytest worker) stops it: no engine outlives its starter
    environ = {**os.environ, **render_environment(env), EXIT_WITH_PARENT: str(os.getpid()), **(extra_env or {})}
    command = [sys.executable, "-m", "kvbridge_agent", "serve", "--log-level", log_level]
    fd, log_path = tempfile.mkstemp(prefix=f"kvbridge-{env.engine_id}-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        process = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=log_file)
    engine = EngineProcess(env, process, log_path)
    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    stdout = process.stdout
    if stdout is None:  # pragma: no cover - PIPE above
        raise ProcessError("no stdout")
    selector.register(stdout, selectors.EVENT_READ)
    line = b""
    try:
        while b'"ready"' not in line or not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or process.poll() is not None:
                break
            if selector.select(timeout=min(remaining, 1.0)):
                chunk = os.read(stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
    finally:
        selector.close()
    ready_lines = [x for x in line.splitlines() if x.startswith(b'{"ready"')]
    if not ready_lines:
        tail = engine.log_tail().strip()
        engine.stop(timeout=5)
        raise ProcessError(f"engine {env.engine_id} did not become ready: {tail or 'no output'}")
    engine.ready = json.loads(ready_lines[0])
    return engine
