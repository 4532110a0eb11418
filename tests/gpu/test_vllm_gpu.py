"""Real vLLM on GPUs, started from exactly the pods the operator renders, through both connectors.

The tiny local model (kvbridge_sim.tiny_model) on vLLM's GPU build: each case renders a DisaggregatedDeployment
with ``engine.device: GPU``, starts its prefill and decode pods' engine containers as local processes (the same
runner as tests/vllm: each pod its own loopback address, the model name mapped to the folder, the GPUs given by
``CUDA_VISIBLE_DEVICES`` as a device plugin would) and compares decode's greedy tokens with a single-engine run
on the decode engine. kvbridge's connector runs with ``verification: All`` (every transfer digested by prefill and
checked by decode before its first token); NixlConnector has no digest, so it runs with ``Off`` (``All`` is
refused for it: tests/operator/test_vllm.py). A negative control per case shows the KV really moved.

Skipped, naming why, without a CUDA device or vLLM's GPU build (conftest.py); a case with prefill TP 2 also
needs two GPUs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .conftest import gpus

if TYPE_CHECKING:
    import aiohttp

    from kvbridge_sim.vllm_engines import Engines

# kvbridge's agent, operator and simulator are imported where a test runs, not here: a GPU machine without the
# operator's dependencies (aiohttp, cryptography, kopf) collects this module and skips it with conftest.py's reason.

MAX_TOKENS = 12
#: a partial single block, a few blocks with a partial last one, and many blocks
LENGTHS = (7, 3 * 32 + 13, 12 * 32 + 5)
#: each engine's share of a GPU's memory: prefill and decode share one GPU where there is only one
GPU_MEMORY_SHARE = "--gpu-memory-utilization=0.2"
PREFILL_IP, DECODE_IP = "127.0.2.2", "127.0.2.3"


@dataclass(frozen=True)
class Case:
    name: str
    connector: str
    blocks: tuple[int, int] = (16, 16)
    prefill_tp: int = 1
    #: spec.transfer.network.kvBufferDevice: cuda (GPUDirect RDMA) or cpu (the host buffer)
    buffer: str = "cuda"

    @property
    def verification(self) -> str:
        return "All" if self.connector == "KVBridge" else "Off"  # NixlConnector has no transfer digest


CASES = [
    Case("nixl", "Nixl"),
    Case("nixl-decode-merges", "Nixl", blocks=(16, 32)),
    Case("nixl-host-buffer", "Nixl", buffer="cpu"),
    Case("nixl-tp2-to-1", "Nixl", prefill_tp=2),
    Case("kvbridge", "KVBridge"),
    Case("kvbridge-blocks-32", "KVBridge", blocks=(32, 32)),
    Case("kvbridge-decode-merges", "KVBridge", blocks=(16, 32)),
    Case("kvbridge-prefill-splits", "KVBridge", blocks=(32, 16)),
    Case("kvbridge-tp2-to-1", "KVBridge", prefill_tp=2),
    Case("kvbridge-host-buffer", "KVBridge", buffer="cpu"),
]


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvbridge_sim import tiny_model

    return tiny_model.make(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The side channel's key pair, as kvbridge's connector gets it from the deployment's Secret."""
    from kvbridge_agent.transfer.keys import generate_keys

    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys)
    return keys


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    from kvbridge_sim import pd_requests

    async with pd_requests.client_session(300) as s:
        yield s


def gpu_deployment(case: Case) -> dict[str, Any]:
    from kvbridge_sim.vllm_engines import deployment

    doc = deployment(
        f"gpu-{case.name}",
        case.prefill_tp,
        connector=case.connector,
        blocks=case.blocks,
        device="GPU",
        verification=case.verification,
        extra=(GPU_MEMORY_SHARE,),
    )
    doc["spec"]["transfer"]["network"] = {"kvBufferDevice": case.buffer}
    return doc


def started(case: Case, model: Path, keys: Path, workdir: Path) -> Engines:
    """The case's prefill and decode engines, running: prefill on the first TP-size GPUs, decode on the last."""
    from kvbridge_agent.core import Role, TransferPlan
    from kvbridge_operator.api.spec import parse_deployment
    from kvbridge_operator.children.verdict import verdict_for
    from kvbridge_sim.vllm_engines import Engines, rendered_template

    doc = gpu_deployment(case)
    plan = verdict_for(parse_deployment(doc))
    assert isinstance(plan, TransferPlan), plan  # the operator renders what it checked
    engines = Engines(workdir, model)
    env = {"KVBRIDGE_KEYS_DIR": str(keys)} if case.connector == "KVBridge" else {}
    prefill_gpus = ",".join(str(index) for index in range(case.prefill_tp))
    engines.add(
        "prefill",
        rendered_template(doc, Role.PREFILL),
        PREFILL_IP,
        (),
        env={**env, "CUDA_VISIBLE_DEVICES": prefill_gpus},
    )
    engines.add(
        "decode",
        rendered_template(doc, Role.DECODE),
        DECODE_IP,
        (),
        env={**env, "CUDA_VISIBLE_DEVICES": str(gpus() - 1)},
    )
    try:
        engines.start(["prefill", "decode"])
    except BaseException:
        engines.stop()
        raise
    return engines


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_decode_on_gpus_answers_as_a_single_engine(
    case: Case, model_path: Path, keys_dir: Path, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    if gpus() < case.prefill_tp:
        pytest.skip(f"prefill TP {case.prefill_tp} needs {case.prefill_tp} GPUs, this machine has {gpus()}")
    from kvbridge_sim import pd_requests
    from kvbridge_sim.tiny_model import prompt
    from kvbridge_sim.vllm_engines import MODEL_NAME

    engines = started(case, model_path, keys_dir, tmp_path / "engines")
    try:
        prefill, decode = engines.engines["prefill"].url, engines.engines["decode"].url
        model = MODEL_NAME
        for length in LENGTHS:
            tokens = prompt(length, salt=700 + length)
            params = await pd_requests.prefill(session, prefill, model, tokens)
            if case.connector == "KVBridge":  # All: prefill digested it, decode checks before its first token
                assert params["kvbridge"]["verify"] is True
                assert set(params["kvbridge"]["digests"]) == {"key", "heads", "rows"}
            got = await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)
            want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt=f"{case.name}-{length}")
            assert got.tokens == want.tokens, f"{case.name}, {length} tokens\n" + engines.log_tails(
                ["prefill", "decode"]
            )
        # negative control: another prompt's KV under these tokens changes the answer (the KV really moved)
        tokens, other = prompt(3 * 32, salt=801), prompt(3 * 32, salt=802)
        foreign = await pd_requests.prefill(session, prefill, model, other)
        got = await pd_requests.decode(session, decode, model, tokens, foreign, MAX_TOKENS)
        want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt=f"{case.name}-negative")
        assert got.tokens != want.tokens
    finally:
        engines.stop()
