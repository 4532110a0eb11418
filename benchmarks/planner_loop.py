"""kvbridge's planner with its loop closed (issue 61): a load ramp on the local cluster, scaled out and back in.

    .venv/bin/python benchmarks/planner_loop.py [--profile measured|computed] [--plot docs/images/planner-loop.png]
                                                [--json FILE] [--quick]

The local cluster of ``kvbridge demo --serve`` (the emulated API, the real operator with ``spec.autoscaling`` on, the
local kubelet stand-in) runs synthetic engines at a set speed (``KVBRIDGE_SYNTHETIC_*``: one prefill at a time,
0.5 ms per prompt token; decode tokens 15 ms apart alone, 5 ms more per other sequence decoding: engines that sleep,
so more pods add capacity on two cores) behind kvbridge's router; a real Prometheus (Debian's ``prometheus``) scrapes
the pods, the router and the operator every second, and the planner reads it (``kvbridge_sim.planner_loop``).

The profile: ``--profile measured`` (the default) runs ``kvbridge profile`` (vLLM's own ``vllm bench serve``)
against the router at one pod of each role before the planner is turned on; ``computed`` writes what the set speed
is by construction. The load (``kvbridge_sim.load_ramp``): Poisson arrivals of streamed completions (150-250 prompt
tokens, 24 output tokens) at 1 request/s, then steps up to 10 with two bursts, then back to 1; a prefill pod is
SIGKILLed halfway up. Targets: TTFT p99 1 s (as the router's clients see it), ITL p99 60 ms.

Printed: the requests within both targets (TTFT, and mean gap between tokens), replica-hours against a static size
at the peak, the time to recover (TTFT p99 over the last 10 s back under target) after each step up, the losses by
phase (failed and hung: scale-in must lose none), each role's changes of direction and the hysteresis that keeps
them few, each role's correction (least and most over the run, read back from Prometheus); ``--plot`` draws the
timeline. ``--quick``: the shortened run of the test (tests/demo/test_planner_loop.py). Ctrl-C (or SIGTERM) stops
the run and everything it started, prints no results and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge_sim.load_ramp import RECOVERY_WINDOW, summary
from kvbridge_sim.planner_loop import FULL, QUICK, Loop, LoopRun, run_loop

ROOT = Path(__file__).resolve().parents[1]


def word_tokenizer(folder: Path) -> Path:
    """A tokenizer whose tokens are whitespace-separated words (``w0``..``w3999``), as the synthetic engine counts a
    text prompt's tokens: the prompts vLLM's client draws are then as long for it as for the engine."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(4000)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return folder


def measure_with_kvbridge_profile(workdir: Path) -> Any:
    """``kvbridge profile`` against the router: prefill's prompt tokens per second (24 prompts of 600 tokens, 8 at
    once), decode's p99 ITL at 1, 4 and 12 requests at once (48 tokens each); prompts drawn by vLLM's client with a
    word-level tokenizer (:func:`word_tokenizer`)."""

    async def measure(url: str) -> dict[str, Any]:
        tokenizer = word_tokenizer(workdir / "words")
        output = workdir / "profile.json"
        command = [
            *(sys.executable, "-m", "kvbridge_operator", "profile", "--prefill-url", url, "--decode-url", url),
            *("--model", "m", "--tokenizer", str(tokenizer), "--engine", "synthetic engine at a set speed"),
            *("--prompt-tokens", "600", "--prefill-concurrency", "8", "--prefill-prompts", "24"),
            *("--context-tokens", "32", "--output-tokens", "48", "--concurrencies", "1,4,12"),
            *("--itl-percentile", "99", "--vllm", str(Path(sys.executable).parent / "vllm"), "-o", str(output)),
        ]
        began = time.monotonic()
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"kvbridge profile failed: {done.stderr[-2000:]}")
        print(f"kvbridge profile: {time.monotonic() - began:.0f} s", file=sys.stderr)
        measured: dict[str, Any] = json.loads(output.read_text())
        return measured

    return measure


def timeline(run: LoopRun) -> dict[str, list[float]]:
    """Per second: the scheduled and sent rates, the rolling TTFT p99, each role's planned and ready sizes."""
    end = int(max((s.at for s in run.samples), default=0))
    sent = np.array([s.at for s in run.sent])
    ttfts = [(s.at, s.ttft if s.ok and s.ttft is not None else np.inf) for s in run.sent]
    out: dict[str, list[float]] = {k: [] for k in ("t", "rate", "sent", "ttftP99", "pP", "pD", "rP", "rD")}
    by_second = {int(s.at): s for s in run.samples}
    for second in range(end + 1):
        sample = by_second.get(second)
        if sample is None:
            continue
        window = [t for at, t in ttfts if second - RECOVERY_WINDOW < at <= second]
        out["t"].append(second)
        out["rate"].append(sample.rate)
        out["sent"].append(float(np.sum((sent > second - 5) & (sent <= second))) / 5)
        out["ttftP99"].append(float(np.percentile(window, 99, method="higher")) if window else np.nan)
        out["pP"].append(sample.planned[0])
        out["pD"].append(sample.planned[1])
        out["rP"].append(sample.ready[0])
        out["rD"].append(sample.ready[1])
    return out


def plot(run: LoopRun, loop: Loop, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line = timeline(run)
    figure, (rate, ttft, pods) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    rate.step(line["t"], line["rate"], where="post", label="scheduled", color="grey")
    rate.plot(line["t"], line["sent"], label="sent (5 s mean)", color="black", linewidth=0.8)
    rate.set_ylabel("requests/s")
    rate.legend(loc="upper left")
    shown = np.minimum(np.array(line["ttftP99"], dtype=float), 20.0)
    ttft.plot(line["t"], shown, color="tab:red", label="TTFT p99 (last 10 s)")
    ttft.axhline(loop.ttft_ms / 1000, color="tab:red", linestyle="--", label=f"target {loop.ttft_ms / 1000:g} s")
    ttft.set_yscale("log")
    ttft.set_ylabel("seconds")
    ttft.legend(loc="upper left")
    for key, label, color, style in (
        ("pP", "prefill planned", "tab:blue", "--"),
        ("rP", "prefill ready", "tab:blue", "-"),
        ("pD", "decode planned", "tab:green", "--"),
        ("rD", "decode ready", "tab:green", "-"),
    ):
        pods.step(line["t"], line[key], where="post", color=color, linestyle=style, label=label)
    pods.set_ylabel("pods")
    pods.set_xlabel("seconds")
    pods.legend(loc="upper left")
    for at, name in run.killed:
        for axis in (rate, ttft, pods):
            axis.axvline(at, color="black", linestyle=":", linewidth=0.8)
        pods.annotate(f"{name} killed", (at, 0.2), fontsize=8)
    figure.suptitle("kvbridge planner, loop closed: a ramp on the local cluster (synthetic engines at a set speed)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def table(result: dict[str, Any], loop: Loop, run: LoopRun) -> str:
    rows = [
        ("requests sent", f"{result['requests']}"),
        (
            "within both targets (TTFT, mean gap between tokens)",
            f"{result['withinBoth']} ({100 * result['withinBothShare']:.2f} %)",
        ),
        ("TTFT p99, whole run", f"{result['ttftP99Seconds']:.3f} s (target {loop.ttft_ms / 1000:g} s)"),
        (
            "replica-hours (planner / static at the peak)",
            f"{result['replicaHours']:.3f} / {result['staticPeakReplicaHours']:.3f} "
            f"({100 * result['replicaHours'] / max(result['staticPeakReplicaHours'], 1e-9):.0f} %)",
        ),
        ("peak pods (prefill, decode)", f"{result['peakPods']['prefill']}, {result['peakPods']['decode']}"),
    ]
    for step in result["recoveries"]:
        rows.append(
            (
                f"recovered after {step['rate']} req/s (at {step['at']:g} s)",
                f"{step['recoveredSeconds']:g} s (worst TTFT p99 {step['worstTtftSeconds']:g} s)",
            )
        )
    for phase, losses in result["byPhase"].items():
        rows.append((f"{phase}: sent / failed / hung", f"{losses['sent']} / {losses['failed']} / {losses['hung']}"))
    rows.append(("failures by code", json.dumps(result["failures"]) if result["failures"] else "none"))
    for role, turns in result["reversals"].items():
        rows.append((f"{role}: changes of direction (at s)", f"{len(turns)} {[round(t) for t in turns]}"))
    rows.append(("prefill pod killed", ", ".join(f"{n} at {t:.0f} s" for t, n in run.killed) or "none"))
    low, high = (
        run.prometheus.get(f"{edge}_over_time(kvbridge_operator_planner_correction[1h])", []) for edge in ("min", "max")
    )
    for role in ("prefill", "decode"):
        seen = [f"{s['value']:.2f}" for series in (low, high) for s in series if s["labels"].get("role") == role]
        rows.append((f"{role}: correction, least and most over the run", " to ".join(seen) or "not read"))
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=["measured", "computed"], default="measured")
    parser.add_argument("--plot", help="write the timeline here (PNG)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="the test's shortened run")
    args = parser.parse_args()
    loop = QUICK if args.quick else FULL
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbridge-planner-loop-") as folder:
        workdir = Path(folder)
        measure = measure_with_kvbridge_profile(workdir) if args.profile == "measured" else None
        try:
            run = asyncio.run(run_loop(loop, workdir, measure))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("planner loop: interrupted; no results", file=sys.stderr)
            return 130
    result = summary(run.sent, run.samples, loop.segments, loop.targets)
    result |= {"wallSeconds": round(time.monotonic() - began), "profile": run.profile, "prometheus": run.prometheus}
    print(table(result, loop, run))
    print(f"\nprofile: {json.dumps(run.profile)}\nwall: {result['wallSeconds']} s")
    print("planner events:", *run.events[-12:], sep="\n  ")
    if args.json:
        Path(args.json).write_text(json.dumps(result | {"timeline": timeline(run)}, indent=1, default=str))
    if args.plot:
        plot(run, loop, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
