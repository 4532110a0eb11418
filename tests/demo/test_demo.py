"""`kvbridge demo` end to end (scaled down): the operator, local pods, real transfers, a prefill restart."""

from __future__ import annotations

import io
import ipaddress
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kvbridge_sim.demo import DEFAULT_FILES, MANIFESTS


def marked_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"KVBRIDGE_DEMO_MARKER={marker}".encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


#: the synthetic demo's two default manifests (one run also takes pods of data-parallel ranks on both roles)
SYNTHETIC_MANIFESTS = [str(MANIFESTS / name) for name in DEFAULT_FILES["synthetic"]]
#: prefill DP 2 and decode DP 3 per pod (examples/synthetic/data-parallel-mla.yaml, one prefill pod here: 5 rank
#: processes)
DATA_PARALLEL = Path(__file__).parents[2] / "examples" / "synthetic" / "data-parallel-mla.yaml"


@pytest.mark.slow  # the whole demo with synthetic engines, up to 3 minutes (`make test` runs it)
def test_synthetic_demo_json_contract(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    started = time.monotonic()
    wide = yaml.safe_load(DATA_PARALLEL.read_text())
    wide["spec"]["prefill"]["replicas"] = 1
    (tmp_path / "data-parallel.yaml").write_text(yaml.safe_dump(wide))
    files = [arg for path in [*SYNTHETIC_MANIFESTS, str(tmp_path / "data-parallel.yaml")] for arg in ("-f", path)]
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "demo", "--engine=synthetic", "--json", "--requests=4", *files],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "KVBRIDGE_DEMO_MARKER": marker},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert time.monotonic() - started < 180
    report = json.loads(result.stdout)
    assert report["ok"] is True
    by_name = {d["name"]: d for d in report["deployments"]}

    hetero = by_name["llama3-8b"]
    assert hetero["conditions"] == {
        "Compatible": "True",
        "PrefillReady": "True",
        "DecodeReady": "True",
        "Available": "True",
        "Ready": "True",
    }
    assert hetero["plan"]["tpRatio"] == -2
    assert sorted(e["pod"] for e in hetero["endpoints"]) == ["llama3-8b-prefill-0", "llama3-8b-prefill-1"]
    # each pod on a loopback address of the demo's own (kvbridge_sim.support.pod_addresses)
    assert all(ipaddress.ip_address(e["ip"]).is_loopback for e in hetero["endpoints"])
    assert all(e["port"] == 5600 and e["ranks"] == 2 for e in hetero["endpoints"])
    assert hetero["transfers"]["requests"] == hetero["transfers"]["verified"] == 4
    assert hetero["transfers"]["verifiedAfterPrefillRestart"] >= 1
    assert hetero["transfers"]["failures"] == []
    assert hetero["transfers"]["check"] == "bytes"

    refused = by_name["replicated-heads"]
    assert refused["conditions"]["Compatible"] == "False"
    assert refused["pods"] == 0
    reasons = {(e["object"].split("/")[1], e["reason"]) for e in report["events"]}
    assert ("replicated-heads", "Incompatible") in reasons
    assert ("llama3-8b", "PrefillRestarted") in reasons
    warning = next(e for e in report["events"] if e["reason"] == "Incompatible")
    assert "PREFILL_HEADS_REPLICATED" in warning["message"]
    assert "killing prefill pod" in result.stderr  # progress output while it runs
    # the request sent right after the kill went to the other prefill pod (through the router, which retries)
    assert hetero["transfers"]["duringOutage"]["status"] == 200
    assert hetero["transfers"]["router"]["requests"] == {"ok": 5}

    wide = by_name["data-parallel-mla"]  # every prefill DP rank published as a transfer peer of its own
    assert wide["conditions"]["Ready"] == "True"
    for endpoint in wide["endpoints"]:
        assert [(r["engineId"], r["port"]) for r in endpoint["dataParallelRanks"]] == [
            (f"{endpoint['pod']}_dp0", 5600),
            (f"{endpoint['pod']}_dp1", 5601),
        ]
    assert wide["transfers"]["requests"] == wide["transfers"]["verified"] == 4
    assert wide["transfers"]["verifiedAfterPrefillRestart"] >= 1
    assert wide["transfers"]["failures"] == []

    time.sleep(1)
    assert marked_processes(marker) == [], "the demo left processes behind"


@pytest.mark.vllm
@pytest.mark.slow  # real engines: they want the cores to themselves (`make test`'s serial stage)
def test_vllm_demo_runs_real_engines_and_checks_tokens() -> None:
    """The default demo: real vLLM (CPU build) pods from the rendered templates, a prefill restart halfway."""
    from tests.vllm.assertions import require_vllm

    require_vllm()
    marker = uuid.uuid4().hex
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "demo", "--json", "--requests", "4"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "KVBRIDGE_DEMO_MARKER": marker},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["ok"] is True
    by_name = {d["name"]: d for d in report["deployments"]}
    tiny = by_name["tiny-cpu"]
    assert tiny["conditions"]["Ready"] == "True"
    transfers = tiny["transfers"]
    assert transfers["check"] == "tokens"
    assert transfers["requests"] == transfers["verified"] == 4
    assert transfers["verifiedAfterPrefillRestart"] == 2
    assert transfers["failures"] == []
    assert [e["httpPort"] for e in tiny["endpoints"]] == [8000]
    reasons = {(e["object"].split("/")[1], e["reason"]) for e in report["events"]}
    assert ("tiny-cpu", "PrefillRestarted") in reasons
    assert ("replicated-heads", "Incompatible") in reasons
    assert "decode's 12 tokens equal a single engine's" in result.stderr
    # one prefill pod: the request sent right after its kill fails at once with a clear 5xx, never hangs
    outage = transfers["duringOutage"]
    assert outage["status"] in (502, 503)
    assert outage["code"] in ("PREFILL_UNAVAILABLE", "NO_ROUTE")
    assert outage["seconds"] < 10
    assert transfers["router"]["requests"]["ok"] == 4
    time.sleep(1)
    assert marked_processes(marker) == [], "the demo left processes behind"


def test_demo_reads_a_manifest_from_stdin_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13 #10: `kvbridge demo -f -` read stdin twice and applied nothing (then said ok)."""
    from kvbridge_sim.demo import documents

    text = (Path(__file__).parents[2] / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    [doc] = documents(["-"], num_layers=4, engine="synthetic")
    assert doc["metadata"]["name"] == "llama3-8b"
    assert doc["spec"]["model"]["numLayers"] == 4  # synthetic engines are scaled down


def test_the_synthetic_engine_is_named_synthetic_and_its_former_names_are_still_read() -> None:
    """Issue 57: the demo wrote the deprecated ``engine.kind: Agent`` and keyed its manifests ``agent``; it writes
    ``Synthetic``, keys them ``synthetic``, and still reads ``--engine agent`` and ``kind: Agent``."""
    from kvbridge_operator.api.spec import EngineKind, parse_deployment
    from kvbridge_sim.demo import documents, serves_model, synthetic_deployment

    written = synthetic_deployment("s")
    assert written["spec"]["engine"]["kind"] == "Synthetic"
    assert parse_deployment(written).spec.engine.kind is EngineKind.SYNTHETIC
    assert documents(None, num_layers=4, engine="agent") == documents(None, num_layers=4, engine="synthetic")
    kinds = {k: serves_model({"spec": {"engine": {"kind": k}}}) for k in ("Synthetic", "Agent", "VLLM")}
    assert kinds == {"Synthetic": False, "Agent": False, "VLLM": True}
    assert serves_model({"spec": {}})  # VLLM, the default kind
    assert serves_model({})


def test_serve_keeps_the_cluster_up_for_your_own_clients_and_ctrl_c_stops_everything() -> None:
    """``kvbridge demo --serve``: a kubeconfig for the emulated API and a router URL on stdout; a request through the
    router and kubectl against the API work; SIGINT stops every process it started."""
    import re
    import shutil
    import signal
    import urllib.request

    marker = uuid.uuid4().hex
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_operator", "demo", "--serve", "--engine", "synthetic"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVBRIDGE_DEMO_MARKER": marker},
    )
    try:
        assert process.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("serving:"):
                break
        assert lines, process.stderr.read() if process.stderr and process.poll() is not None else "no output"
        assert lines[-1].startswith("serving:"), lines
        config = re.search(r"^kubeconfig (\S+)", "".join(lines), re.M)
        router = re.search(r"^router llama3-8b (\S+) model meta-llama/Llama-3.1-8B-Instruct ", "".join(lines), re.M)
        assert config, lines
        assert router, lines
        assert any(line.startswith("not served replicated-heads") for line in lines)
        request = urllib.request.Request(
            router.group(1) + "/v1/completions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "demo", "prompt": [5] * 40}).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["kvbridge"]["verified"] is True
        if shutil.which("kubectl"):
            got = subprocess.run(
                ["kubectl", "get", "dd", "llama3-8b"],
                capture_output=True,
                text=True,
                timeout=30,
                env={**os.environ, "KUBECONFIG": config.group(1)},
                check=False,
            )
            assert got.returncode == 0, got.stderr
            # NAME READY AVAILABLE PREFILL DECODE ...
            assert got.stdout.split("\n")[1].split()[:5] == ["llama3-8b", "True", "True", "2/2", "1/1"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    time.sleep(1)
    assert marked_processes(marker) == [], "the demo left processes behind"
