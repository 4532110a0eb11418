"""kvbridge's planner with its loop closed (issue 61): on the local cluster, synthetic engines at a set speed behind
the router, a real Prometheus scraping them, the real operator with ``spec.autoscaling`` on.

- The short ramp (``QUICK``, `make test`'s slow stage): 1 -> 3 -> 6 requests/s and back to 1, a prefill pod SIGKILLed
  once two run; 110 s of load. It costs about 2 minutes on two cores: 114-117 s of test (116-119 s with pytest's
  start) in seven runs at load average 1-6, 146 s in one at load average 12 (docs/autoscaling.md).
- The whole ramp (``FULL``, the benchmark's, `make planner-loop-test`): 1 -> 10 -> 1 requests/s with bursts; about
  10 minutes (565 s measured).

Each asserts what must hold whatever else loads the machine (its timings are bounds, not figures): both roles
scaled out within 30 s of the step to the peak, scaled back in after it (prefill to one pod; decode below its peak;
the pods drained to what is planned), no request failed or hung (the killed pod's and the scale-in's included), at
most one change of direction per role (the hysteresis, planner.hysteresis), and the decisions in Prometheus.

The profile is :func:`~kvbridge_sim.planner_loop.computed_profile`, what the set speed is by construction (the
benchmark measures it with ``kvbridge profile``; tests/operator/test_profile.py shows that command reads a set-speed
engine within a few percent).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvbridge_sim.load_ramp import summary
from kvbridge_sim.local_prometheus import PROMETHEUS
from kvbridge_sim.planner_loop import FULL, QUICK, Loop, run_loop

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")
#: how long after the step to the peak both roles must have been asked to scale out (a pass every 5 s over a 10 s
#: window sees the step within 15 s; the rest is for a loaded machine's late timers)
SCALE_OUT_BOUND = 30.0


async def closed_loop(loop: Loop, workdir: Path) -> None:
    began = time.monotonic()
    run = await run_loop(loop, workdir)
    result = summary(run.sent, run.samples, loop.segments, loop.targets)
    print(json.dumps({k: v for k, v in result.items() if k != "recoveries"} | {"wall": time.monotonic() - began}))
    phases = [seg.phase for seg in loop.segments]
    peak_at = sum(seg.seconds for seg in loop.segments[: phases.index("peak")])
    out = [s for s in run.samples if s.at <= peak_at + SCALE_OUT_BOUND]
    assert max(s.planned[0] for s in out) >= 2, f"prefill not scaled out within {SCALE_OUT_BOUND:g} s of the peak"
    assert max(s.planned[1] for s in out) >= 2, f"decode not scaled out within {SCALE_OUT_BOUND:g} s of the peak"
    last = run.samples[-1]
    assert last.planned == last.pods, f"pods not drained to the planned sizes: {last}"
    assert last.planned[0] == 1, f"prefill not scaled back in: {last}"
    assert last.planned[1] < max(s.planned[1] for s in run.samples), f"decode not scaled back in: {last}"
    assert run.killed, "no prefill pod was killed"
    assert (result["failed"], result["hung"]) == (0, 0), result["failures"]
    turns = result["reversals"]
    assert len(turns["prefill"]) <= 1, f"prefill oscillated: changes of direction at {turns['prefill']}"
    assert len(turns["decode"]) <= 1, f"decode oscillated: changes of direction at {turns['decode']}"
    # the decisions, seen: the planner's own series, scraped from the operator by the same Prometheus
    decided = {(s["labels"]["role"], s["labels"]["change"]): s["value"] for s in next(iter(run.prometheus.values()))}
    assert decided[("prefill", "up")] >= 1
    assert decided[("decode", "down")] >= 1
    assert any(e.startswith("Planned: ") for e in run.events)


@pytest.mark.slow  # engine pods, a Prometheus and two minutes of load: about 2 minutes
async def test_the_planner_scales_out_under_a_short_ramp_and_back_in_losing_nothing(tmp_path: Path) -> None:
    await closed_loop(QUICK, tmp_path)


@pytest.mark.slow
@pytest.mark.planner_loop  # the benchmark's whole ramp: about 10 minutes, `make planner-loop-test`
async def test_the_planner_scales_out_under_the_whole_ramp_and_back_in_losing_nothing(tmp_path: Path) -> None:
    await closed_loop(FULL, tmp_path)
