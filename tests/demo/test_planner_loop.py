"""kvbridge's planner with its loop closed (issue 61; the shortened run of ``benchmarks/planner_loop.py``): on the
local cluster, synthetic engines at a set speed behind the router, a real Prometheus scraping them, the real
operator with ``spec.autoscaling`` on; 1 -> 3 -> 6 requests/s and back to 1, a prefill pod SIGKILLed once two run.
The planner scales both roles out under the ramp and back in after it, each role's planned size changes direction
once (up, then down: no oscillation), and no request fails or hangs, the killed pod's and the scale-in's included.

The profile is :func:`~kvbridge_sim.planner_loop.computed_profile`, what the set speed is by construction (the
benchmark measures it with ``kvbridge profile``; tests/operator/test_profile.py shows that command reads a set-speed
engine within a few percent). About 2.5 minutes on two cores (`make test` runs it in its slow stage).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvbridge_sim.load_ramp import summary
from kvbridge_sim.local_prometheus import PROMETHEUS
from kvbridge_sim.planner_loop import QUICK, run_loop

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")


@pytest.mark.slow  # engine pods, a Prometheus and two minutes of load
@pytest.mark.planner_loop  # timed: out of `make test` until it holds on a loaded machine
async def test_the_planner_scales_out_under_a_ramp_and_back_in_losing_nothing(tmp_path: Path) -> None:
    began = time.monotonic()
    run = await run_loop(QUICK, tmp_path)
    result = summary(run.sent, run.samples, QUICK.segments, QUICK.targets)
    print(json.dumps({k: v for k, v in result.items() if k != "recoveries"} | {"wall": time.monotonic() - began}))
    peak = [s for s in run.samples if s.rate == max(seg.rate for seg in QUICK.segments)]
    assert max(s.planned[0] for s in peak) >= 2, "prefill was not scaled out under the ramp"
    assert max(s.planned[1] for s in peak) >= 2, "decode was not scaled out under the ramp"
    assert run.samples[-1].planned == run.samples[-1].pods == (1, 1), "not scaled back in after the ramp"
    assert run.killed, "no prefill pod was killed"
    assert (result["failed"], result["hung"]) == (0, 0), result["failures"]
    turns = result["reversals"]
    assert (len(turns["prefill"]), len(turns["decode"])) == (1, 1), f"oscillation: changes of direction at {turns}"
    # the decisions, seen: the planner's own series, scraped from the operator by the same Prometheus
    decided = {(s["labels"]["role"], s["labels"]["change"]): s["value"] for s in next(iter(run.prometheus.values()))}
    assert decided[("prefill", "up")] >= 1
    assert decided[("decode", "down")] >= 1
    assert any(e.startswith("Planned: ") for e in run.events)
