"""One set of real vLLM engines for the whole test session (starting one takes about a minute here)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge_agent.core import Role
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_sim import tiny_model
from kvbridge_sim.support import fixed_address, free_port
from kvbridge_sim.vllm_engines import Engines, deployment, plan_json, plan_json_pod, rendered_template

from .assertions import require_vllm

HERE = Path(__file__).parent
SUMMARY: dict[str, object] = {}
#: prefill's blocks on the short-lease engine: few, so that later requests reuse a request's freed blocks
SHORT_LEASE_BLOCKS = 48
SHORT_LEASE_SECONDS = 2

TRACES_PORT = free_port()
TRACES_URL = f"http://127.0.0.1:{TRACES_PORT}/v1/traces"
#: decode merges two of prefill's blocks into one of its own: every traced read has a conversion span. The pair
#: serves the tiny mixture-of-experts model with expert parallelism on (what the CPU build runs of MoE: EP size 1),
#: so the same engines prove MoE P/D with kvbridge's connector (test_traced_moe) at no extra start-up
traced = deployment("tiny-traced", 1, connector="KVBridge", blocks=(32, 64), shape=tiny_model.MOE, expert_parallel=True)
DEPLOYMENTS = {
    "tp1": deployment("tiny-tp1", 1),
    "tp2": deployment("tiny-tp2", 2),
    "kvbridge": deployment("tiny-kvbridge", 1, connector="KVBridge"),
    # block-size conversions NixlConnector gets wrong on CPU attention: decode merges, prefill splits
    "kvbridge-merge": deployment("tiny-kvbridge-merge", 1, connector="KVBridge", blocks=(32, 64)),
    "kvbridge-split": deployment("tiny-kvbridge-split", 1, connector="KVBridge", blocks=(64, 32)),
    "kvbridge-tp2": deployment("tiny-kvbridge-tp2", 2, connector="KVBridge"),
    # full attention and a 32-token sliding window: vLLM's hybrid allocator makes two KV cache groups, which
    # kvbridge's connector moves on the CPU build too (in the layer slot they share)
    "kvbridge-hybrid": deployment(
        "tiny-kvbridge-hybrid", 1, connector="KVBridge", verification="All", shape=tiny_model.HYBRID
    ),
    # Gemma-3's layer pattern (5 sliding : 1 global, a 32-token window): prompts at the window's edge (test_gemma3)
    "kvbridge-gemma3": deployment(
        "tiny-kvbridge-gemma3", 1, connector="KVBridge", verification="All", shape=tiny_model.GEMMA3
    ),
    # spec.tracing: OTLP/HTTP to the receiver test_tracing runs on this port (chosen once per session)
    "traced": {**traced, "spec": {**traced["spec"], "tracing": {"endpoint": TRACES_URL, "protocol": "http/protobuf"}}},
    # staged reads (docs/protocol.md §4d): every transfer verified; the staging buffers come from the pods' environment
    "kvbridge-staged": deployment("tiny-kvbridge-staged", 1, connector="KVBridge", verification="All"),
    "short-lease": deployment(
        "tiny-short-lease", 1, lease=SHORT_LEASE_SECONDS, extra=(f"--num-gpu-blocks-override={SHORT_LEASE_BLOCKS}",)
    ),
}


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    return tiny_model.make(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def all_engines(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """Every engine the tests use, rendered once; each phase starts the ones it needs."""
    found = Engines(tmp_path_factory.mktemp("engines"), tiny_model_path)
    for shape in (tiny_model.HYBRID, tiny_model.MOE, tiny_model.GEMMA3):
        folder = tmp_path_factory.mktemp("model") / shape.name.split("/")[-1]
        found.more_models[shape.name] = tiny_model.make(folder, shape)
    models = found.models
    plans = tmp_path_factory.mktemp("plans")

    def from_plan_json(name: str, deployment_name: str, role: Role, ip: str, core: int, **env: str) -> None:
        """An engine started from ``kvbridge plan --json`` alone (docs/cli.md): the TP-1 engines of both connectors
        run so, and test_pd/test_kvbridge_connector compare their tokens with a single engine's."""
        spec = plan_json_pod(
            plan_json(DEPLOYMENTS[deployment_name], plans),
            role,
            name,
            ip,
            found.workdir / name,
            models=models,
            cpus=(core,),
            env_overrides=env,
        )
        found.add_spec(name, ip, spec)

    from_plan_json("decode", "tp1", Role.DECODE, fixed_address(5), 1)
    from_plan_json("prefill-tp1", "tp1", Role.PREFILL, fixed_address(2), 0)
    found.add(
        "prefill-short-lease", rendered_template(DEPLOYMENTS["short-lease"], Role.PREFILL), fixed_address(4), (0,)
    )
    found.add("prefill-tp2", rendered_template(DEPLOYMENTS["tp2"], Role.PREFILL), fixed_address(3), (0, 1))
    # kvbridge's connector: the Secret's key pair, as the pods mount it
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys)
    found.keys_dir = keys
    from_plan_json("kvbridge-prefill", "kvbridge", Role.PREFILL, fixed_address(6), 0, KVBRIDGE_KEYS_DIR=str(keys))
    from_plan_json("kvbridge-decode", "kvbridge", Role.DECODE, fixed_address(7), 1, KVBRIDGE_KEYS_DIR=str(keys))
    # a second pod of each role of the same deployment: one of each is sent SIGTERM under load (test_drain)
    for name, role, ip, core in (
        ("kvbridge-prefill-b", Role.PREFILL, fixed_address(12), 0),
        ("kvbridge-decode-b", Role.DECODE, fixed_address(13), 1),
    ):
        found.add(
            name, rendered_template(DEPLOYMENTS["kvbridge"], role), ip, (core,), env={"KVBRIDGE_KEYS_DIR": str(keys)}
        )
    # spec.tracing: their spans go to test_tracing's receiver, exported at once (not every 5 s)
    for name, role, ip, core in (
        ("traced-prefill", Role.PREFILL, fixed_address(14), 0),
        ("traced-decode", Role.DECODE, fixed_address(15), 1),
    ):
        env = {"KVBRIDGE_KEYS_DIR": str(keys), "OTEL_BSP_SCHEDULE_DELAY": "100"}
        found.add(name, rendered_template(DEPLOYMENTS["traced"], role), ip, (core,), env=env)
    for name, deployment_name, role, ip, core in (
        ("kvbridge-decode-64", "kvbridge-merge", Role.DECODE, fixed_address(8), 1),  # reads the 32-token prefill
        ("kvbridge-prefill-64", "kvbridge-split", Role.PREFILL, fixed_address(9), 0),  # read by the 32-token decode
    ):
        found.add(
            name,
            rendered_template(DEPLOYMENTS[deployment_name], role),
            ip,
            (core,),
            env={"KVBRIDGE_KEYS_DIR": str(keys)},
        )
    for name, role, ip, core in (
        ("kvbridge-hybrid-prefill", Role.PREFILL, fixed_address(16), 0),
        ("kvbridge-hybrid-decode", Role.DECODE, fixed_address(17), 1),
    ):
        template = rendered_template(DEPLOYMENTS["kvbridge-hybrid"], role)
        found.add(name, template, ip, (core,), env={"KVBRIDGE_KEYS_DIR": str(keys)})
    for name, role, ip, core in (
        ("kvbridge-gemma3-prefill", Role.PREFILL, fixed_address(18), 0),
        ("kvbridge-gemma3-decode", Role.DECODE, fixed_address(19), 1),
    ):
        template = rendered_template(DEPLOYMENTS["kvbridge-gemma3"], role)
        found.add(name, template, ip, (core,), env={"KVBRIDGE_KEYS_DIR": str(keys)})
    # staged reads on both roles, forced (KVBRIDGE_STAGING_MODE=staged): decode reads every request through them
    staged = {"KVBRIDGE_KEYS_DIR": str(keys), "KVBRIDGE_STAGING_MIB": "64", "KVBRIDGE_STAGING_MODE": "staged"}
    for name, role, ip, core in (
        ("kvbridge-staged-prefill", Role.PREFILL, fixed_address(20), 0),
        ("kvbridge-staged-decode", Role.DECODE, fixed_address(21), 1),
    ):
        found.add(name, rendered_template(DEPLOYMENTS["kvbridge-staged"], role), ip, (core,), env=staged)
    # TP 2 -> 1 with kvbridge's connector: the prefill ranks on cores of their own (where there are 4)
    found.add(
        "kvbridge-prefill-tp2",
        rendered_template(DEPLOYMENTS["kvbridge-tp2"], Role.PREFILL),
        fixed_address(10),
        (2, 3),
        env={"KVBRIDGE_KEYS_DIR": str(keys)},
    )
    found.add(
        "kvbridge-decode-tp2",
        rendered_template(DEPLOYMENTS["kvbridge-tp2"], Role.DECODE),
        fixed_address(11),
        (1,),
        env={"KVBRIDGE_KEYS_DIR": str(keys)},
    )
    try:
        yield found
    finally:
        found.stop()
        SUMMARY.update(found.summary())


def _phase(engines: Engines, wanted: list[str]) -> Engines:
    """Run exactly ``wanted`` (plus nothing else): two cores do not hold every engine at once. Each vLLM worker's
    NIXL agent runs a progress thread that keeps a core busy even when idle, and with four engines (five agents)
    on two cores a handshake missed vLLM's fixed 5 s timeout."""
    engines.stop([name for name in engines.engines if name not in wanted and engines.running(name)])
    missing = [name for name in wanted if not engines.running(name)]
    if missing:
        engines.start(missing)
    return engines


@pytest.fixture
def tp1_engines(all_engines: Engines) -> Engines:
    """decode TP 1, prefill TP 1 and the short-lease prefill TP 1."""
    return _phase(all_engines, ["decode", "prefill-tp1", "prefill-short-lease"])


@pytest.fixture
def kvbridge_engines(all_engines: Engines) -> Engines:
    """prefill TP 1 and decode TP 1 with kvbridge's KVBridgeConnector, blocks of 32 tokens on both, plus a
    64-token decode and a 64-token prefill (no NIXL progress threads: four engines fit on two cores)."""
    return _phase(all_engines, ["kvbridge-prefill", "kvbridge-decode", "kvbridge-decode-64", "kvbridge-prefill-64"])


@pytest.fixture
def kvbridge_hybrid_engines(all_engines: Engines) -> Engines:
    """prefill TP 1 and decode TP 1 of the hybrid tiny model (full attention + a 32-token sliding window) with
    kvbridge's connector, verification All."""
    return _phase(all_engines, ["kvbridge-hybrid-prefill", "kvbridge-hybrid-decode"])


@pytest.fixture
def kvbridge_gemma3_engines(all_engines: Engines) -> Engines:
    """prefill TP 1 and decode TP 1 of the tiny Gemma-3 (6 layers: 5 with a 32-token window, then 1 global) with
    kvbridge's connector, verification All."""
    return _phase(all_engines, ["kvbridge-gemma3-prefill", "kvbridge-gemma3-decode"])


@pytest.fixture
def kvbridge_staged_engines(all_engines: Engines) -> Engines:
    """prefill TP 1 and decode TP 1 with kvbridge's connector, verification All, and 64 MiB staging buffers on both
    with staging forced (``KVBRIDGE_STAGING_MODE=staged``): every read goes through them."""
    return _phase(all_engines, ["kvbridge-staged-prefill", "kvbridge-staged-decode"])


@pytest.fixture
def traced_engines(all_engines: Engines) -> Engines:
    """prefill TP 1 and decode TP 1 of the tiny mixture-of-experts model, expert parallel, with kvbridge's connector
    and spec.tracing (OTLP/HTTP to ``TRACES_URL``)."""
    return _phase(all_engines, ["traced-prefill", "traced-decode"])


@pytest.fixture
def kvbridge_pairs(all_engines: Engines) -> Engines:
    """Two prefill and two decode pods of one KVBridgeConnector deployment (blocks of 32 tokens): every pod has
    a compatible partner left when one is terminated."""
    return _phase(all_engines, ["kvbridge-prefill", "kvbridge-prefill-b", "kvbridge-decode", "kvbridge-decode-b"])


#: prefill TP 2 beside a decode engine: a core per prefill rank, one for decode, one for the NIXL progress threads
TP2_CORES = 4


def _require_tp2_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    if cores < TP2_CORES:
        pytest.skip(f"prefill TP 2 beside a decode engine needs {TP2_CORES} cores, this machine has {cores}")


@pytest.fixture
def tp2_engines(all_engines: Engines) -> Engines:
    """decode TP 1 and prefill TP 2 (two ranks, one core each).

    Needs 4 cores. On 2 cores it was tried and does not work (docs/vllm.md, "What was run for real"): the two
    prefill ranks must run at the same time for every all-reduce, while every NIXL agent's progress thread keeps
    a core busy even when idle; a decode engine beside them made the prefill's start-up or the decode's first
    READ take more than 10 minutes."""
    _require_tp2_cores()
    return _phase(all_engines, ["decode", "prefill-tp2"])


@pytest.fixture
def kvbridge_tp2_engines(all_engines: Engines) -> Engines:
    """prefill TP 2 (cores 2 and 3) and decode TP 1 (core 1) with kvbridge's connector.

    Needs 4 cores. On 2 it was tried (prefill ranks on both cores, decode beside them) and decode's handshake
    timed out after 5, 60 and 120 s: while a finished request's blocks are held for decode, vLLM keeps stepping
    the prefill engine, whose two TP workers busy-poll their shared-memory queues, so three spinning processes
    on two cores starve the prefill engine's side-channel listener and the decode front end (docs/vllm.md)."""
    _require_tp2_cores()
    return _phase(all_engines, ["kvbridge-prefill-tp2", "kvbridge-decode-tp2"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here runs real engines: each gets the ``vllm`` marker (skipped without vLLM, tests/conftest.py) and
    the ``slow`` one (`make test` runs them one at a time, after the rest: engines want the cores to themselves)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARY:
        terminalreporter.write_line(f"real vLLM engines: {json.dumps(SUMMARY)}")
