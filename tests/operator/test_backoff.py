"""Retries after API faults (issue 13 #5): the backoff policy and the client's retries of transient failures."""

from __future__ import annotations

import random
from collections.abc import Mapping

import kmock
import pytest

from kvbridge_operator.backoff import Backoff
from kvbridge_operator.kube import CALL_ATTEMPTS, DEPLOYMENTS, ApiError, KubeClient
from kvbridge_sim.apiserver import RealisticKubernetes


def test_delays_double_up_to_the_cap_and_are_jittered() -> None:
    backoff = Backoff(base=0.5, cap=4.0, attempts=8, rng=random.Random(1))
    delays = list(backoff)
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert len(delays) == 8
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len({round(d, 6) for d in delays[3:]}) > 1  # jittered: capped retries do not line up
    assert list(backoff) != delays  # every iteration draws anew (Kopf iterates once per failure series)
    assert backoff.delay(10_000) <= 4.0


async def test_transient_failures_are_retried_and_others_are_not() -> None:
    failures = {"left": CALL_ATTEMPTS - 1}

    def faults(verb: str, plural: str, headers: Mapping[str, str]) -> tuple[int, float] | None:
        if plural == "disaggregateddeployments" and failures["left"] > 0:
            failures["left"] -= 1
            return (503, 0.0)
        return None

    async with RealisticKubernetes() as api, kmock.Server(api) as server:
        api.faults = faults
        client = KubeClient.for_url(str(server.url))
        try:
            assert await client.get(DEPLOYMENTS, "default", "missing") is None  # 4 x 503, then the real 404
            assert failures["left"] == 0
            failures["left"] = CALL_ATTEMPTS  # one more than the client tries
            with pytest.raises(ApiError) as caught:
                await client.get(DEPLOYMENTS, "default", "missing")
            assert caught.value.status == 503
            seen: list[str] = []

            def invalid(verb: str, plural: str, headers: Mapping[str, str]) -> tuple[int, float]:
                seen.append(verb)
                return (422, 0.0)

            api.faults = invalid  # not transient: one try
            with pytest.raises(ApiError) as caught:
                await client.list(DEPLOYMENTS, "default")
            assert (caught.value.status, len(seen)) == (422, 1)
        finally:
            await client.close()
