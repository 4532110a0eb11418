"""The synthetic engine's set speed (synthetic/pace.py): one prefill at a time for its time per token, in arrival
order; decode tokens apart by a latency that grows with the sequences decoding; the ``vllm:`` series the planner
reads; and, end to end, a prefill and a decode engine process paced through their OpenAI routes."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.synthetic.pace import (
    DECODE_ITL_MS,
    DECODE_ITL_MS_PER_SEQUENCE,
    MOST_MS,
    PREFILL_MS_PER_TOKEN,
    Pace,
    Pacer,
    paced,
)
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.synthetic.ranks import EngineError
from kvbridge_agent.transfer.keys import generate_keys


def test_unset_is_as_fast_as_it_goes_and_each_variable_is_read() -> None:
    assert Pace.from_environ({}) == Pace()
    assert not Pace().decodes
    pace = Pace.from_environ({PREFILL_MS_PER_TOKEN: "0.5", DECODE_ITL_MS: " 20 ", DECODE_ITL_MS_PER_SEQUENCE: "5"})
    assert pace == Pace(0.5, 20.0, 5.0)
    assert pace.decodes
    assert pace.itl_seconds(1) == pytest.approx(0.020)
    assert pace.itl_seconds(4) == pytest.approx(0.035)  # three others decoding: 3 x 5 ms more


@given(st.sampled_from([PREFILL_MS_PER_TOKEN, DECODE_ITL_MS, DECODE_ITL_MS_PER_SEQUENCE]), st.text(max_size=30))
def test_any_value_is_a_pace_in_range_or_a_refusal_naming_the_variable(name: str, text: str) -> None:
    refusal: SpecError | None = None
    try:
        pace = Pace.from_environ({name: text})
    except SpecError as exc:
        refusal = exc
    if refusal is not None:
        assert (refusal.code, refusal.field) == ("INVALID_ENVIRONMENT", name)
        assert name in refusal.message
    else:
        assert all(0 <= v <= MOST_MS for v in (pace.prefill_ms_per_token, pace.decode_itl_ms))
        assert 0 <= pace.decode_itl_ms_per_sequence <= MOST_MS


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "1e9", "fast"])
def test_out_of_range_or_no_number_is_refused(text: str) -> None:
    with pytest.raises(SpecError, match=PREFILL_MS_PER_TOKEN):
        Pace.from_environ({PREFILL_MS_PER_TOKEN: text})


def test_one_prefill_at_a_time_in_arrival_order_each_for_its_tokens() -> None:
    pacer = Pacer(Pace(prefill_ms_per_token=1.0), Role.PREFILL)
    order: list[int] = []

    def prefill(index: int) -> None:
        with pacer.prefilling(30):  # 30 ms each
            order.append(index)

    started = time.monotonic()
    threads = []
    for index in range(4):
        threads.append(threading.Thread(target=prefill, args=(index,)))
        threads[-1].start()
        time.sleep(0.005)  # arrive in this order (each arrives while the first still holds the slot)
    for thread in threads:
        thread.join(timeout=10)
    assert order == [0, 1, 2, 3]
    assert time.monotonic() - started >= 0.12  # one after the other: 4 x 30 ms
    text = pacer.render().decode()
    assert 'vllm:request_success_total{finished_reason="length"} 4.0' in text
    assert "vllm:prompt_tokens_total 120.0" in text
    assert "vllm:prefix_cache_queries_total 120.0" in text
    assert "vllm:num_requests_waiting 0.0" in text


def test_a_prefill_that_fails_counts_no_success_and_frees_the_slot() -> None:
    pacer = Pacer(Pace(), Role.PREFILL)
    with pytest.raises(RuntimeError), pacer.prefilling(5):
        raise RuntimeError("the engine refused it")
    with pacer.prefilling(5):
        pass
    assert "vllm:prompt_tokens_total 5.0" in pacer.render().decode()


def test_decode_tokens_come_apart_by_a_latency_that_grows_with_the_sequences_decoding() -> None:
    pacer = Pacer(Pace(decode_itl_ms=10, decode_itl_ms_per_sequence=10), Role.DECODE)
    alone = _gaps(pacer, 6)
    assert all(0.009 <= g < 0.05 for g in alone), alone
    others = [pacer.tokens(100, 1) for _ in range(2)]
    for other in others:
        next(other)  # two more sequences decoding: 10 + 2 x 10 ms
    crowded = _gaps(pacer, 6)
    for other in others:
        other.close()
    assert all(g >= 0.029 for g in crowded), crowded
    text = pacer.render().decode()
    assert "vllm:num_requests_running 0.0" in text  # closed sequences are no longer counted
    assert "vllm:generation_tokens_total 14.0" in text  # 6 + 6 + the others' first tokens
    assert 'vllm:request_success_total{finished_reason="length"} 2.0' in text  # the closed ones did not finish
    assert "vllm:inter_token_latency_seconds_count 10.0" in text


def _gaps(pacer: Pacer, count: int) -> list[float]:
    times = []
    for _ in pacer.tokens(count, 8):
        times.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(times)]


ANSWER: dict[str, Any] = {
    "id": "cmpl-x",
    "object": "text_completion",
    "model": "m",
    "usage": {"prompt_tokens": 8, "completion_tokens": 0, "total_tokens": 8},
    "choices": [{"index": 0, "finish_reason": "length", "text": ""}],
    "kvbridge": {"verified": True},
}


def test_a_paced_decode_streams_one_event_per_token_then_the_usage_when_asked() -> None:
    pacer = Pacer(Pace(decode_itl_ms=1), Role.DECODE)
    body = {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = paced(pacer, ANSWER, body, False, True)
    assert isinstance(events, Iterator)
    data = [e.decode().removeprefix("data: ").strip() for e in events]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == [" t"] * 3
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[0]["kvbridge"] == {"verified": True}
    assert "kvbridge" not in chunks[1]
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"]["completion_tokens"] == 3
    whole = paced(pacer, ANSWER, {"max_tokens": 2}, True, False)
    assert isinstance(whole, dict)
    assert whole["choices"][0]["message"]["content"] == " t t"
    assert whole["usage"] == {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}


@pytest.mark.parametrize("wanted", [0, -1, 5000, "16", True, 1.5])
def test_a_max_tokens_out_of_range_is_refused_when_decode_is_paced(wanted: object) -> None:
    pacer = Pacer(Pace(decode_itl_ms=1), Role.DECODE)
    with pytest.raises(EngineError) as raised:
        paced(pacer, ANSWER, {"max_tokens": wanted}, False, False)
    assert (raised.value.code, raised.value.field) == ("INVALID_REQUEST", "max_tokens")


def test_unpaced_decode_answers_as_before_and_is_counted() -> None:
    pacer = Pacer(Pace(), Role.DECODE)
    assert paced(pacer, ANSWER, {"max_tokens": 99999}, False, True) is None
    assert paced(pacer, {"kv_transfer_params": {}, **ANSWER}, {}, False, False) is None  # a prefill's: as it is
    assert 'vllm:request_success_total{finished_reason="length"} 1.0' in pacer.render().decode()


# -- end to end: two engine processes, paced through their environment ------------------------------------------------

MODEL = ModelGeometry(name="m", num_layers=1, num_kv_heads=2, head_dim=16)
PACE = {PREFILL_MS_PER_TOKEN: "2", DECODE_ITL_MS: "20", DECODE_ITL_MS_PER_SEQUENCE: "0"}


def _env(role: Role, name: str, keys: Path) -> EngineEnvironment:
    return EngineEnvironment(
        role=role,
        engine_id=name,
        model=MODEL,
        prefill=RoleSettings(),
        decode=RoleSettings(),
        keys_dir=str(keys),
        num_blocks=32,
        http_port=0,
        side_channel_listen_port=0,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys)
    started = [start_engine(_env(r, f"paced-{r.value}", keys), extra_env=PACE) for r in (Role.PREFILL, Role.DECODE)]
    try:
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def _post(engine: EngineProcess, body: dict[str, Any]) -> tuple[list[float], bytes]:
    """POST /v1/completions; when each piece of the answer arrived, and the whole answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{engine.ready['httpPort']}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    times, data = [], b""
    with urllib.request.urlopen(request, timeout=30) as answer:
        while piece := answer.read1(65536):
            times.append(time.monotonic())
            data += piece
    return times, data


def test_engine_processes_prefill_and_stream_at_their_set_speed(engines: tuple[EngineProcess, EngineProcess]) -> None:
    prefill, decode = engines
    began = time.monotonic()
    _, offered = _post(prefill, {"prompt": [5] * 50, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert time.monotonic() - began >= 0.1  # 50 tokens x 2 ms
    params = json.loads(offered)["kv_transfer_params"]
    body = {"prompt": [5] * 50, "max_tokens": 5, "stream": True, "kv_transfer_params": params}
    times, data = _post(decode, {**body, "stream_options": {"include_usage": True}})
    events = [e for e in data.decode().split("\n\n") if e.startswith("data: {")]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:5]] == [" t"] * 5
    assert json.loads(events[0][6:])["kvbridge"]["verified"] is True
    assert times[-1] - times[0] >= 0.075  # the tokens came apart: 4 gaps of 20 ms (first piece at once)
    with urllib.request.urlopen(f"http://127.0.0.1:{decode.ready['httpPort']}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert 'vllm:request_success_total{finished_reason="length"} 1.0' in text
    assert "vllm:generation_tokens_total 5.0" in text
    assert "kvbridge_transfer_seconds" in text  # the engine's own series are still there
