"""Client authentication (spec.router.apiKeySecret): OpenAI-style bearer keys, compared in constant time against every
key, a missing or wrong key answered 401 before any engine is called; /health and /metrics stay open."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import pytest

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.router_settings import API_KEYS_VARIABLE
from kvbridge_router import cli
from kvbridge_router.auth import API_KEYS_UNREADABLE, RECHECK_SECONDS, ApiKeys
from kvbridge_router.proxy import RouterConfig

from .test_proxy import running_rig

KEYS = "sk-first-key-0001\n\n  sk-second-key-0002  \n"


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text(KEYS)
    return path


@pytest.mark.parametrize(
    ("header", "said"),
    [
        (None, "no API key"),
        ("", "no API key"),
        ("sk-first-key-0001", "must be 'Bearer KEY'"),  # no scheme
        ("Basic sk-first-key-0001", "must be 'Bearer KEY'"),
        ("Bearer ", "must be 'Bearer KEY'"),
        ("Bearer sk-first-key-000", "not one of this router's"),  # a prefix of a key
        ("Bearer sk-first-key-00012", "not one of this router's"),
        ("Bearer sk-second-key-0002 x", "not one of this router's"),
    ],
)
def test_a_missing_or_wrong_key_is_refused(key_file: Path, header: str | None, said: str) -> None:
    refusal = ApiKeys(str(key_file)).refused(header)
    assert refusal is not None
    assert said in refusal


@pytest.mark.parametrize("header", ["Bearer sk-first-key-0001", "bearer sk-second-key-0002", "Bearer  sk-env-key "])
def test_any_configured_key_passes_from_the_file_or_the_variable(key_file: Path, header: str) -> None:
    keys = ApiKeys.configured(str(key_file), {API_KEYS_VARIABLE: "sk-env-key, sk-env-other"}, API_KEYS_VARIABLE)
    assert keys is not None
    assert len(keys) == 4
    assert keys.refused(header) is None


def test_every_key_is_compared_whichever_matches(key_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The time taken says nothing of which key matched, or how much of one: every key is compared each time, as
    equal-length digests."""
    compared: list[tuple[int, int]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = ApiKeys(str(key_file), "sk-third")
    for header in ("Bearer sk-first-key-0001", "Bearer wrong", "Bearer sk-third"):
        compared.clear()
        keys.refused(header)
        assert compared == [(32, 32)] * 3


def test_no_keys_given_is_no_authentication_and_a_variable_without_keys_is_refused() -> None:
    assert ApiKeys.configured("", {}, API_KEYS_VARIABLE) is None
    assert ApiKeys.configured("", {API_KEYS_VARIABLE: " "}, API_KEYS_VARIABLE) is None
    with pytest.raises(SpecError) as caught:  # keys were meant, none given: never an open router
        ApiKeys.configured("", {API_KEYS_VARIABLE: " , "}, API_KEYS_VARIABLE)
    assert caught.value.code == API_KEYS_UNREADABLE


@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_a_key_file_that_is_missing_or_empty_stops_the_router(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "api-keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError) as caught:
        ApiKeys(str(path))
    assert caught.value.code == API_KEYS_UNREADABLE


def test_the_file_is_read_again_when_the_secret_changes(key_file: Path) -> None:
    """A rotated Secret reaches the mounted file; the router takes its keys within RECHECK_SECONDS, and keeps the
    keys last read when the file becomes unreadable or empty (a rotation gone wrong never opens the router)."""
    now = [0.0]
    keys = ApiKeys(str(key_file), clock=lambda: now[0])
    key_file.write_text("sk-rotated-key\n")
    os.utime(key_file, (1e9, 1e9))
    assert keys.refused("Bearer sk-first-key-0001") is None  # not looked at yet
    now[0] += RECHECK_SECONDS
    assert keys.refused("Bearer sk-first-key-0001") is not None
    assert keys.refused("Bearer sk-rotated-key") is None
    for broken in ("", None):
        if broken is None:
            key_file.unlink()
        else:
            key_file.write_text(broken)
            os.utime(key_file, (2e9, 2e9))
        now[0] += RECHECK_SECONDS
        assert keys.refused("Bearer sk-rotated-key") is None


def test_the_router_does_not_start_without_its_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "dd.json").write_text("{}")
    argv = ["--status-file", str(tmp_path / "dd.json"), "--api-key-file", str(tmp_path / "missing")]
    assert cli.main(argv) == 2
    assert "API_KEYS_UNREADABLE" in capsys.readouterr().err


async def test_a_request_without_a_key_is_401_before_any_engine_is_called(key_file: Path) -> None:
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, api_keys=ApiKeys(str(key_file)))
    async with running_rig(config, ["prefill-0"], ["decode-0"]) as rig:
        engines = (*rig.prefill, *rig.decode)
        for headers in ({}, {"Authorization": "Bearer sk-nope"}):
            for path in ("/v1/completions", "/v1/chat/completions"):
                async with rig.session.post(rig.url + path, json={"prompt": [1]}, headers=headers) as r:
                    assert r.status == 401
                    assert r.headers["WWW-Authenticate"].startswith("Bearer")
                    error = (await r.json())["error"]
                    assert (error["type"], error["code"]) == ("invalid_request_error", "INVALID_API_KEY")
            async with rig.session.get(rig.url + "/v1/models", headers=headers) as r:
                assert r.status == 401
        assert all(not engine.received for engine in engines)
        # health and metrics stay open, and count the refusals
        async with rig.session.get(rig.url + "/health") as r:
            assert r.status == 200
        async with rig.session.get(rig.url + "/metrics") as r:
            assert 'kvbridge_router_requests_total{outcome="INVALID_API_KEY",route="completions"} 2.0' in await r.text()
        good = {"Authorization": "Bearer sk-second-key-0002"}
        async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1]}, headers=good) as r:
            assert r.status == 200
        async with rig.session.get(rig.url + "/v1/models", headers=good) as r:
            assert r.status == 200
        assert [len(engine.received) for engine in engines] == [1, 1]
