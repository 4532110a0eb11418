"""Issue 59: while the demo waits for readiness, a pod whose engine keeps exiting is reported as it happens, with the
last lines its engine wrote, and the demo gives up at the crash-loop threshold instead of at its timeout (900 s for
vLLM). Before, three GPU-flag `vllm serve` processes crash-looped for minutes while the only output was
"PrefillReady: 0/2"."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from kvbridge_operator.api.names import ENGINE_CONTAINER, LABEL_DEPLOYMENT, MANAGED_BY
from kvbridge_operator.kube import DEPLOYMENTS, PODS, STATEFUL_SETS
from kvbridge_sim.demo_wait import CRASH_LOOP_RESTARTS, NAMESPACE, DemoError, wait_for_verdicts
from kvbridge_sim.local_api import emulated_api
from kvbridge_sim.runner import LocalRunner, terminated

NAME = "crashing"
#: what the engine prints before it exits, a second after it started (each restart seen by the demo's 0.5 s look):
#: what vLLM does with a flag its CPU build refuses
CRASH = (
    "import sys, time; print('starting', flush=True); time.sleep(1); print('ValueError: no CUDA device'); sys.exit(3)"
)


def deployment() -> dict[str, object]:
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": NAME},
        "spec": {"engine": {"kind": "Agent"}, "model": {"name": "m", "numLayers": 2, "numKVHeads": 4, "headDim": 64}},
    }


def stateful_set(command: str) -> dict[str, object]:
    labels = {**MANAGED_BY, LABEL_DEPLOYMENT: NAME}
    container = {"name": ENGINE_CONTAINER, "image": "x", "command": [sys.executable, "-c", command]}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": f"{NAME}-prefill", "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


async def test_a_crash_looping_pod_is_reported_and_ends_the_wait_early(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with emulated_api() as (_api, _url, client):
        runner, stop = LocalRunner(client, tmp_path), asyncio.Event()
        running = asyncio.create_task(runner.run(stop))
        try:
            await client.create(DEPLOYMENTS, NAMESPACE, deployment())
            await client.create(STATEFUL_SETS, NAMESPACE, stateful_set(CRASH))
            started = time.monotonic()
            with pytest.raises(DemoError) as gave_up:
                await wait_for_verdicts(client, [NAME], timeout=120, logs=runner.pod_log)
            assert time.monotonic() - started < 60  # at the threshold, not at the timeout
            pod = await client.get(PODS, NAMESPACE, f"{NAME}-prefill-0")
        finally:
            stop.set()
            await running
            await runner.close()
    message = str(gave_up.value)
    assert f"pod {NAME}-prefill-0 restarted {CRASH_LOOP_RESTARTS} times" in message
    assert "crash loop" in message
    assert "exit code 3" in message
    assert "ValueError: no CUDA device" in message  # the last lines the engine wrote
    said = capsys.readouterr().err
    for restart in range(1, CRASH_LOOP_RESTARTS):  # each restart reported as it happened, with its log
        assert f"pod {NAME}-prefill-0 restarted (restart {restart}; its engine ended with exit code 3)" in said
    assert said.count("| ValueError: no CUDA device") >= CRASH_LOOP_RESTARTS
    # the pod's status says how its last container ended, as a kubelet's does (kubectl describe pod)
    assert pod is not None
    [status] = pod["status"]["containerStatuses"]
    assert status["restartCount"] >= CRASH_LOOP_RESTARTS
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert "startedAt" in status["state"]["running"]


async def test_a_pod_that_keeps_running_is_not_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with emulated_api() as (_api, _url, client):
        runner, stop = LocalRunner(client, tmp_path), asyncio.Event()
        running = asyncio.create_task(runner.run(stop))
        try:
            await client.create(DEPLOYMENTS, NAMESPACE, deployment())
            await client.create(STATEFUL_SETS, NAMESPACE, stateful_set("import time; time.sleep(60)"))
            with pytest.raises(DemoError, match="not settled after 2 s"):  # never Ready here: no operator runs
                await wait_for_verdicts(client, [NAME], timeout=2, logs=runner.pod_log)
        finally:
            stop.set()
            await running
            await runner.close()
    assert "restarted" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("returncode", "code", "reason"), [(0, 0, "Completed"), (1, 1, "Error"), (-9, 137, "Error"), (-15, 143, "Error")]
)
def test_an_ended_container_is_reported_as_a_container_runtime_reports_it(
    returncode: int, code: int, reason: str
) -> None:
    ended = terminated(returncode, "2026-01-01T00:00:00Z")
    assert (ended["exitCode"], ended["reason"], ended["startedAt"]) == (code, reason, "2026-01-01T00:00:00Z")
