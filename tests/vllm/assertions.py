"""What the vLLM tests check, beside the engines of kvbridge_sim.vllm_engines."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvbridge_sim import pd_requests
from kvbridge_sim.vllm_engines import VLLM


def require_vllm() -> None:
    """Skip where vLLM's CPU build is not installed; in CI (where `make test` installs it) that is a failure."""
    if VLLM.exists():
        return
    message = f"vLLM's CPU build is not installed ({VLLM} is missing): run `make setup`"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


async def assert_pd_equals_single_engine(
    session: Any,
    prefill_url: str,
    decode_url: str,
    model: str,
    tokens: list[int],
    max_tokens: int,
    salt: str,
    what: str = "",
) -> None:
    """Prefill on one engine, decode on the other with its KV: the greedy tokens equal a single-engine run on the
    decode engine (salted, so it cannot reuse the blocks P/D requests left in its prefix cache)."""
    got = await pd_requests.disaggregated(session, prefill_url, decode_url, model, tokens, max_tokens)
    want = await pd_requests.baseline(session, decode_url, model, tokens, max_tokens, salt=salt)
    assert len(got.tokens) == max_tokens
    assert got.tokens == want.tokens, f"{what}: P/D {got.tokens} != single engine {want.tokens}"


#: what kvbridge's worker logs at registration of a cache of several KV cache groups (vllm_connector/worker.py)
_GROUPS_LOGGED = re.compile(r"kvbridge: \w+ rank \d+ registered \d+ KV tensor\(s\) of (\d+) KV cache groups")


def registered_cache_groups(log: Path) -> list[int]:
    """The KV cache groups each of an engine's ranks registered with kvbridge's connector (from its log): empty
    where it registered one group."""
    return [int(count) for count in _GROUPS_LOGGED.findall(log.read_text(errors="replace"))]
