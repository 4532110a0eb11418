"""An engine whose starter dies without stopping it (a killed test run, a crashed pytest worker) stops too, ranks
and all, instead of running on as an orphan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_sim.support import running, wait_until

#: a starter: starts one engine, prints its pids, and waits to be killed
STARTER = textwrap.dedent(
    """
    import json, sys, time
    from kvbridge_agent.core.contract import EngineEnvironment, render_environment
    from kvbridge_agent.synthetic.processes import start_engine
    engine = start_engine(EngineEnvironment.model_validate_json(sys.argv[1]))
    print(json.dumps(engine.pids), flush=True)
    time.sleep(600)
    """
)


#: a starter that starts ``kvbridge-agent serve`` as start_engine does and exits at once, before the engine has even
#: imported its modules
HASTY = textwrap.dedent(
    """
    import os, subprocess, sys
    environ = {**os.environ, "KVBRIDGE_EXIT_WITH_PARENT": str(os.getpid())}
    command = [sys.executable, "-m", "kvbridge_agent", "serve"]
    engine = subprocess.Popen(command, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(engine.pid, flush=True)
    os._exit(0)
    """
)

ENV = EngineEnvironment(
    role=Role.PREFILL,
    engine_id="orphan",
    model=ModelGeometry(name="tiny", num_layers=2, num_kv_heads=8, head_dim=32),
    prefill=RoleSettings(tensor_parallel_size=2),
    decode=RoleSettings(tensor_parallel_size=1),
    num_blocks=16,
    http_port=0,
    side_channel_listen_port=0,
)


def test_an_engine_whose_starter_is_killed_stops_with_its_ranks(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, ENV.model_dump_json(by_alias=True)],
        stdout=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # the engine's log file (its stop, which removes it, never runs)
    )
    try:
        pids: list[int] = json.loads(starter.stdout.readline()) if starter.stdout else []
        assert len(pids) == 3  # the engine and its two ranks
        assert all(running(pid) for pid in pids)
    finally:
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
    try:
        wait_until(lambda: not any(running(pid) for pid in pids), 30, "the orphaned engine and its ranks to stop")
    finally:
        for pid in pids:  # never leave one behind, even when the test fails
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_engine_whose_starter_died_before_it_started_does_not_start(tmp_path: Path) -> None:
    environ = {**os.environ, **render_environment(ENV), "TMPDIR": str(tmp_path)}
    starter = subprocess.run(
        [sys.executable, "-c", HASTY], env=environ, capture_output=True, text=True, timeout=60, check=True
    )
    pid = int(starter.stdout)
    try:
        wait_until(lambda: not running(pid), 30, "the engine whose starter was gone to exit")
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
