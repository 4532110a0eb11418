"""``kvbridge profile``: a performance profile from ``vllm bench serve`` runs (cli/profile.py, planner/profile.py).

The derivation is checked on bench results written out here; the command end to end runs vLLM's own client,
``vllm bench serve``, against a stand-in engine whose speed is set (an OpenAI-compatible server: one prefill at a
time taking a fixed time per request, tokens streamed with a latency that grows with the requests in flight), so
the profile it writes can be checked against what the engine was made to do. Against real vLLM engines it is run
by hand (docs/autoscaling.md has a real profile).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvbridge_agent.core import KVBridgeError, SpecError
from kvbridge_operator.api.autoscaling import AutoscalingSpec
from kvbridge_operator.cli.main import main
from kvbridge_operator.controller.autoscaling import read_profile
from kvbridge_operator.planner.profile import PerformanceProfile, profile_from_bench

ROOT = Path(__file__).parents[2]


def bench(**values: Any) -> dict[str, Any]:
    """A ``vllm bench serve`` result as ``--save-result`` writes it (the fields the profile reads)."""
    return {"completed": 8, "failed": 0, "duration": 2.0, "total_input_tokens": 8192, "errors": [""] * 8, **values}


def test_a_profile_is_the_prefill_rate_and_the_decode_latency_at_its_percentile() -> None:
    profile = profile_from_bench(
        "tiny, vLLM 0.32, CPU",
        bench(),
        {4: bench(p90_itl_ms=12.5), 1: bench(p90_itl_ms=8.0), 16: bench(p90_itl_ms=31.25)},
        90,
        1056,
    )
    assert profile.prefill.tokens_per_second == 4096.0  # 8,192 prompt tokens in 2 s
    assert [(p.concurrency, p.itl_ms) for p in profile.decode.points] == [(1, 8.0), (4, 12.5), (16, 31.25)]
    assert profile.decode.context_tokens == 1056
    stored = profile.model_dump(by_alias=True, mode="json")
    assert stored["prefill"] == {"tokensPerSecond": 4096.0}
    assert stored["decode"]["itlPercentile"] == 90  # the planner uses it for a p90 ITL target only
    assert PerformanceProfile.model_validate(stored) == profile  # what the planner reads back
    assert profile_from_bench("e", bench(), {1: bench(**{"p99.5_itl_ms": 3.0})}, 99.5, 10).decode.points[0].itl_ms == 3


@pytest.mark.parametrize(
    ("prefill", "decode", "field", "words"),
    [
        (bench(completed=6, failed=2, errors=["", "Bad Request: no such model"]), {}, "--prefill-url", "no such model"),
        (bench(completed=0, failed=0, errors=[]), {}, "--prefill-url", "0 requests completed"),
        (bench(duration=0.0), {}, "--prefill-url", "no duration"),
        (bench(total_input_tokens=0), {}, "--prefill-url", "no prompt tokens"),
        (bench(), {1: bench(failed=1)}, "--decode-url", "decode at concurrency 1"),
        (bench(), {1: bench(p90_itl_ms=float("nan"))}, "--output-tokens", "no inter-token latency"),
        (bench(), {1: bench()}, "--output-tokens", "no inter-token latency at p90"),
    ],
)
def test_a_bench_that_failed_or_measured_nothing_gives_no_profile(
    prefill: dict[str, Any], decode: dict[int, dict[str, Any]], field: str, words: str
) -> None:
    with pytest.raises(KVBridgeError) as raised:
        profile_from_bench("e", prefill, decode or {1: bench(p90_itl_ms=5.0)}, 90, 10)
    assert (raised.value.code, raised.value.field) == ("PROFILE_REQUESTS_FAILED", field)
    assert words in raised.value.message


def test_an_output_that_cannot_be_written_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    urls = ["--prefill-url", "http://127.0.0.1:9", "--decode-url", "http://127.0.0.1:9"]
    vllm = ["--vllm", sys.executable]  # an executable: the check of the output comes before any run
    status = main(["profile", *urls, "--model", "m", "--engine", "e", *vllm, "-o", str(tmp_path / "no" / "p.json")])
    assert status == 2
    assert "PROFILE_OUTPUT (--output)" in capsys.readouterr().err


def test_without_vllm_to_run_the_command_says_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    urls = ["--prefill-url", "http://127.0.0.1:9", "--decode-url", "http://127.0.0.1:9"]
    status = main(["profile", *urls, "--model", "m", "--engine", "e", "--vllm", "no-such-vllm-here"])
    assert status == 2
    err = capsys.readouterr().err
    assert "PROFILE_NEEDS_VLLM (--vllm)" in err
    assert "vllm bench serve" in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--concurrencies", "1,x"], "not a comma-separated list"),
        (["--concurrencies", "0,4"], "each from 1 to"),
        (["--output-tokens", "1"], "not at least 2"),
        (["--concurrencies", "1,100001"], "each from 1 to 100000"),
        (["--itl-percentile", "99.95"], "not from 50 to 99.9"),
        (["--itl-percentile", "ninety"], "not a number"),
        (["--engine", ""], "1 to 512 characters"),
        (["--configmap", "My_Profile"], "not a ConfigMap name"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    urls = ["--prefill-url", "http://127.0.0.1:9", "--decode-url", "http://127.0.0.1:9"]
    with pytest.raises(SystemExit) as exited:
        main(["profile", *urls, "--model", "m", "--engine", "e", *flags])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


#: the stand-in engine: each prefill holds the one prefill slot this long, and each token after the first comes
#: after BASE + PER_REQUEST x the requests streaming
PREFILL_SECONDS, BASE_ITL, PER_REQUEST_ITL = 0.05, 0.004, 0.002


class StandIn:
    def __init__(self) -> None:
        self.prefill = asyncio.Lock()
        self.streaming = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async with self.prefill:
            await asyncio.sleep(PREFILL_SECONDS)
        self.streaming += 1
        try:
            for index in range(int(body["max_tokens"])):
                if index:
                    await asyncio.sleep(BASE_ITL + PER_REQUEST_ITL * self.streaming)
                chunk = {"choices": [{"index": 0, "text": " a", "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        finally:
            self.streaming -= 1
        usage = {"choices": [], "usage": {"completion_tokens": int(body["max_tokens"])}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response


@pytest.fixture
async def stand_in() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", StandIn().completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_the_command_measures_a_stand_in_engine_with_vllms_own_client(stand_in: str, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from kvbridge_sim import tiny_model

    tokenizer = tiny_model.make(tmp_path / "tiny-llama")
    output = tmp_path / "profile.yaml"
    vllm = Path(sys.executable).parent / "vllm"
    command = [
        *(sys.executable, "-m", "kvbridge_operator", "profile"),
        *("--prefill-url", stand_in, "--decode-url", stand_in + "/"),
        *("--model", "tiny", "--tokenizer", str(tokenizer), "--engine", "stand-in engine"),
        *("--prompt-tokens", "64", "--prefill-concurrency", "4", "--prefill-prompts", "12"),
        *("--context-tokens", "32", "--output-tokens", "24", "--concurrencies", "1,4"),
        *("--vllm", str(vllm), "--configmap", "tiny-profile", "-o", str(output), "--timeout", "120"),
    ]
    env = {"PYTHONPATH": f"{ROOT / 'agent'}:{ROOT / 'operator'}:{ROOT / 'sim'}", "PATH": str(vllm.parent)}
    began = time.monotonic()
    finished = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, env=env, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "kvbridge profile: decode: 8 requests of 24 tokens, 4 at once: done" in finished.stderr
    import yaml

    config_map = yaml.safe_load(output.read_text())
    assert config_map["metadata"]["name"] == "tiny-profile"
    profile = PerformanceProfile.model_validate_json(config_map["data"]["profile.json"])
    assert profile.engine == "stand-in engine"
    # one prefill at a time, 50 ms each, 64 tokens: 1,280 tokens/s (less the client's own time)
    assert 0.6 * 64 / PREFILL_SECONDS <= profile.prefill.tokens_per_second <= 1.05 * 64 / PREFILL_SECONDS
    one, four = profile.decode.points
    assert (one.concurrency, four.concurrency) == (1, 4)
    assert 1000 * (BASE_ITL + PER_REQUEST_ITL) <= one.itl_ms < four.itl_ms  # more requests streaming, slower tokens
    assert four.itl_ms >= 1000 * (BASE_ITL + 3 * PER_REQUEST_ITL)
    assert profile.decode.context_tokens == 32 + 12
    print(f"kvbridge profile against the stand-in: {time.monotonic() - began:.1f} s, {profile.model_dump()}")


class ConfigMaps:
    """What read_profile asks of the API: one ConfigMap."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data = data

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "data": self.data}


@pytest.mark.parametrize(
    ("measured", "target", "refused"), [(90, 95, True), (95, 95, False), (99, 95, False), (None, 99, False)]
)
def test_the_planner_uses_a_profile_only_at_its_targets_itl_percentile(
    measured: float | None, target: float, refused: bool
) -> None:
    latencies = bench(p90_itl_ms=8.0, p95_itl_ms=9.0, p99_itl_ms=11.0)
    profile = profile_from_bench("e", bench(), {1: latencies}, measured or 90, 10)
    stored = profile.model_dump(by_alias=True, mode="json")
    if measured is None:  # a profile written before the percentile was stored: taken as the target's
        del stored["decode"]["itlPercentile"]
    spec = AutoscalingSpec.model_validate(
        {
            "enabled": True,
            "prometheusUrl": "http://prometheus:9090",
            "ttft": {"milliseconds": 500},
            "itl": {"milliseconds": 50, "percentile": target},
            "profile": {"name": "profile"},
        }
    )
    read = read_profile(ConfigMaps({"profile.json": json.dumps(stored)}), "default", spec)  # type: ignore[arg-type]
    if not refused:
        assert asyncio.run(read).decode.points[0].concurrency == 1
        return
    with pytest.raises(SpecError) as caught:
        asyncio.run(read)
    assert caught.value.code == "ProfileInvalid"
    assert "p90, below the ITL target's p95" in caught.value.message
    assert "kvbridge profile --itl-percentile 95" in caught.value.message
