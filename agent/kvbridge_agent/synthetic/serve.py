"""``kvbridge-agent serve``: run one engine of the agent worker (all its data-parallel ranks) until SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.synthetic.data_parallel import DataParallelEngines
from kvbridge_agent.synthetic.http_api import AgentHTTPServer
from kvbridge_agent.synthetic.pace import Pace
from kvbridge_agent.synthetic.processes import EXIT_WITH_PARENT
from kvbridge_agent.transfer.keys import load_keys

log = logging.getLogger(__name__)

#: how often the engine's components are checked while serving
HEALTH_CHECK_SECONDS = 0.5
#: exit status when a rank or the side-channel listener died (the pod is restarted)
EXIT_UNHEALTHY = 3


def serve(env: EngineEnvironment, *, log_level: str = "WARNING") -> int:
    """Start ranks, side channel and HTTP; print one JSON ready line on stdout; stop on SIGTERM/SIGINT (0), or
    exit with :data:`EXIT_UNHEALTHY` when a rank process or the side-channel listener dies."""
    stop = threading.Event()
    parent = _parent_to_follow()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if _orphaned(parent):  # its starter died while this process was starting
        log.warning("the process that started this engine (pid %d) is gone: not starting", parent)
        return 0
    keys = load_keys(env.keys_dir) if env.keys_dir else None
    engine = DataParallelEngines(env, keys, log_level=log_level, pace=Pace.from_environ(os.environ))
    http: AgentHTTPServer | None = None
    try:
        engine.start()
        http = AgentHTTPServer(
            env.http_host,
            env.http_port,
            engine,
            request_seconds=env.http_request_seconds,
            max_connections=env.http_max_connections,
        )
        http.start()
        ready = {
            "ready": True,
            "role": env.role.value,
            "engineId": env.engine_id,
            "incarnation": engine.incarnation,
            "httpPort": http.port,
            "sideChannelPort": engine.data_parallel_ranks()[0]["sideChannelPort"],
            "rankPids": engine.rank_pids(),
        }
        if len(engine.members) > 1:  # each DP rank a transfer peer: its engine id, incarnation and side channel
            ready["dataParallelRanks"] = engine.data_parallel_ranks()
        sys.stdout.write(json.dumps(ready) + "\n")
        sys.stdout.flush()
        while not stop.wait(HEALTH_CHECK_SECONDS):
            if _orphaned(parent):  # its starter died without stopping it
                log.warning("the process that started this engine (pid %d) is gone: stopping", parent)
                break
            problems = engine.problems()
            if problems:  # exit so that the kubelet restarts the pod: fresh ranks, registrations and handshakes
                log.error("engine cannot serve (%s): exiting", "; ".join(problems))
                sys.stderr.write(json.dumps({"exiting": True, "problems": problems}) + "\n")
                return EXIT_UNHEALTHY
    finally:
        if http is not None:
            left = http.drain(env.drain_seconds)  # SIGTERM: finish what is in flight, refuse what is new
            if left:
                log.warning("drain: %d request(s) still running after %g s; stopping", left, env.drain_seconds)
            http.shutdown()
            http.server_close()
        engine.close()
    return 0


def _parent_to_follow() -> int | None:
    """The pid of the starter this engine stops without (:data:`EXIT_WITH_PARENT`), or None."""
    value = os.environ.get(EXIT_WITH_PARENT, "")
    if not value:
        return None
    if not value.isdigit():
        log.warning("%s=%r is not a process id: ignored", EXIT_WITH_PARENT, value)
        return None
    return int(value)


def _orphaned(parent: int | None) -> bool:
    """Whether the starter this engine follows (if any) is no longer its parent: it died."""
    return parent is not None and os.getppid() != parent
