"""``kvbridge profile``: measure one engine of each role with ``vllm bench serve`` and write the performance profile
the planner reads (``spec.autoscaling.profile``, docs/autoscaling.md).

Prefill: one run at saturation (``--prefill-concurrency`` requests at once, one output token, random prompts drawn
with a fresh seed and no readiness probe, so that the engine's prefix cache holds none of them): the prompt tokens
per second. Decode: one run per ``--concurrencies`` value (that many requests at once, ``--output-tokens`` each,
prompts of ``--context-tokens``): the inter-token latency at ``--itl-percentile``. Each run is vLLM's own client, as
its own process; what it prints goes to stderr, the profile to stdout or ``--output``, as JSON or (``--configmap
NAME``) a ConfigMap to apply. Everything the flags say is checked before the first run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kvbridge_agent.core import KVBridgeError
from kvbridge_operator.api.autoscaling import ConfigMapKeyRef, LatencyTarget
from kvbridge_operator.cli.arguments import at_least
from kvbridge_operator.planner.profile import (
    BenchResult,
    DecodePoint,
    PerformanceProfile,
    percentile_word,
    profile_from_bench,
)

HELP = "measure one prefill and one decode engine with vllm bench serve: the planner's performance profile"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
#: the ConfigMap key the planner reads by default (spec.autoscaling.profile.key)
PROFILE_KEY: str = ConfigMapKeyRef.model_fields["key"].default
#: the percentile an ITL target holds by default (spec.autoscaling.itl.percentile): the profile's, by default
ITL_PERCENTILE: float = LatencyTarget.model_fields["percentile"].default


#: a ConfigMap's name: a DNS subdomain
CONFIG_MAP_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
MOST_CONCURRENCY: int = DecodePoint.model_fields["concurrency"].metadata[1].le


def _concurrencies(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or values[0] < 1 or values[-1] > MOST_CONCURRENCY or len(values) > 32:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 to 32 concurrencies, each from 1 to {MOST_CONCURRENCY}")
    return values


def _percentile(text: str) -> float:
    """argparse type: a percentile an ITL target may hold (spec.autoscaling.itl.percentile's range)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    field = LatencyTarget.model_fields["percentile"].metadata
    low, high = field[0].ge, field[1].le
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value:g} is not from {low:g} to {high:g} (an ITL target's percentile)")
    return value


def _engine(text: str) -> str:
    if not 1 <= len(text) <= 512:
        raise argparse.ArgumentTypeError("give 1 to 512 characters: the model, engine and device measured")
    return text


def _config_map(text: str) -> str:
    if not CONFIG_MAP_NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ConfigMap name (lower-case letters, digits, '-', '.')")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-url", required=True, help="a prefill pod's OpenAI-compatible URL (http://IP:8000)")
    parser.add_argument("--decode-url", required=True, help="a decode pod's OpenAI-compatible URL")
    parser.add_argument("--model", required=True, help="the model name the engines serve")
    parser.add_argument("--tokenizer", help="the tokenizer (name or folder) for the prompts (default: --model)")
    parser.add_argument(
        "--engine",
        required=True,
        type=_engine,
        help='what is measured, stored in the profile: "Llama-3.1-8B, vLLM 0.32, H100"',
    )
    parser.add_argument("--prompt-tokens", type=at_least(1), default=1024, help="prefill prompts (default 1024)")
    parser.add_argument(
        "--prefill-concurrency", type=at_least(1), default=16, help="prefill requests at once (default 16)"
    )
    parser.add_argument("--prefill-prompts", type=at_least(1), default=64, help="prefill requests (default 64)")
    parser.add_argument(
        "--context-tokens", type=at_least(1), default=1024, help="decode prompts: the context (default 1024)"
    )
    parser.add_argument(
        "--output-tokens",
        type=at_least(2),
        default=256,
        help="decode tokens per request (default 256: the decode pod prefills its prompts itself, and each prefill "
        "slows one step; many steps per request keep those out of the percentile)",
    )
    parser.add_argument(
        "--concurrencies",
        type=_concurrencies,
        default=[1, 4, 16],
        help="decode concurrencies, comma-separated (default 1,4,16)",
    )
    parser.add_argument(
        "--itl-percentile",
        type=_percentile,
        default=ITL_PERCENTILE,
        help=f"the ITL percentile the points hold: your ITL target's (default {ITL_PERCENTILE:g}, the target's)",
    )
    parser.add_argument("--vllm", default="vllm", help="the vllm executable (default: vllm on PATH)")
    parser.add_argument(
        "--timeout", type=at_least(10), default=1800, help="seconds each bench run may take (default 1800)"
    )
    parser.add_argument("-o", "--output", help="write the profile here (default: stdout)")
    parser.add_argument(
        "--configmap", metavar="NAME", type=_config_map, help="write a ConfigMap named NAME holding the profile"
    )


def bench_command(
    vllm: str,
    url: str,
    args: argparse.Namespace,
    *,
    input_tokens: int,
    output_tokens: int,
    prompts: int,
    concurrency: int,
    result: Path,
    seed: int,
) -> list[str]:
    """One ``vllm bench serve`` run: random prompts of exactly ``input_tokens`` drawn with ``seed``, ``output_tokens``
    each (EOS ignored), ``concurrency`` at once, no readiness probe (it would send the first prompt once more, and the
    engine would then find it cached), its result saved as JSON at ``result`` with each request's error."""
    return [
        vllm,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url.rstrip("/"),
        "--endpoint",
        "/v1/completions",
        "--model",
        args.model,
        *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_tokens),
        "--random-output-len",
        str(output_tokens),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,itl",
        "--metric-percentiles",
        f"50,{percentile_word(args.itl_percentile)}",
        "--ready-check-timeout-sec",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def run_bench(command: list[str], result: Path, what: str, field: str, timeout: float) -> BenchResult:
    """Run one bench, its output on stderr; its result, or a typed error saying why there is none."""
    began = time.monotonic()
    print(f"kvbridge profile: {what} ...", file=sys.stderr, flush=True)
    try:
        finished = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise KVBridgeError(
            f"{what}: vllm bench serve ran past {timeout:g} s; give --timeout more, or fewer prompts",
            field="--timeout",
            code="PROFILE_TIMEOUT",
        ) from None
    if finished.returncode != 0 or not result.is_file():
        raise KVBridgeError(
            f"{what}: vllm bench serve exited with status {finished.returncode} and no result (its output is "
            "above); check the URL, the model name and that the pod is ready",
            field=field,
            code="PROFILE_REQUESTS_FAILED",
        )
    try:
        loaded: BenchResult = json.loads(result.read_text())
    except (OSError, ValueError) as exc:
        raise KVBridgeError(
            f"{what}: vllm bench serve's result {result.name} cannot be read: {exc}",
            field=field,
            code="PROFILE_REQUESTS_FAILED",
        ) from None
    # on a line of its own: vLLM's client may end its output without a newline
    print(f"\nkvbridge profile: {what}: done in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    return loaded


def measure(args: argparse.Namespace) -> PerformanceProfile:
    vllm = shutil.which(args.vllm)
    if vllm is None:
        raise KVBridgeError(
            f"{args.vllm!r} is not an executable on PATH: kvbridge profile runs vLLM's own client, `vllm bench "
            "serve`; install vLLM where you run it (any build: the client needs no GPU), or give --vllm",
            field="--vllm",
            code="PROFILE_NEEDS_VLLM",
        )
    if args.output:
        target = Path(args.output).resolve().parent
        if not target.is_dir() or not os.access(target, os.W_OK):
            raise KVBridgeError(
                f"cannot write {args.output}: {target} is not a writable folder",
                field="--output",
                code="PROFILE_OUTPUT",
            )
    seeds = random.SystemRandom()  # other prompts every time: a second profile must not find the first one's cached
    with tempfile.TemporaryDirectory(prefix="kvbridge-profile-") as folder:
        where = Path(folder)
        prefill_at = where / "prefill.json"
        command = bench_command(
            vllm,
            args.prefill_url,
            args,
            input_tokens=args.prompt_tokens,
            output_tokens=1,
            prompts=args.prefill_prompts,
            concurrency=args.prefill_concurrency,
            result=prefill_at,
            seed=seeds.randrange(2**31),
        )
        what = (
            f"prefill: {args.prefill_prompts} prompts of {args.prompt_tokens} tokens, "
            f"{args.prefill_concurrency} at once"
        )
        prefill = run_bench(command, prefill_at, what, "--prefill-url", args.timeout)
        decode: dict[int, BenchResult] = {}
        for concurrency in args.concurrencies:
            decode_at = where / f"decode-{concurrency}.json"
            prompts = max(2 * concurrency, 4)
            command = bench_command(
                vllm,
                args.decode_url,
                args,
                input_tokens=args.context_tokens,
                output_tokens=args.output_tokens,
                prompts=prompts,
                concurrency=concurrency,
                result=decode_at,
                seed=seeds.randrange(2**31),
            )
            what = f"decode: {prompts} requests of {args.output_tokens} tokens, {concurrency} at once"
            decode[concurrency] = run_bench(command, decode_at, what, "--decode-url", args.timeout)
    # the points' context: the prompt plus, on average, half the output
    context = args.context_tokens + args.output_tokens // 2
    return profile_from_bench(args.engine, prefill, decode, args.itl_percentile, context)


def rendered(profile: PerformanceProfile, configmap: str | None) -> str:
    document = json.dumps(profile.model_dump(by_alias=True, mode="json"), indent=2) + "\n"
    if configmap is None:
        return document
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": configmap, "labels": {"app.kubernetes.io/managed-by": "kvbridge-profile"}},
        "data": {PROFILE_KEY: document},
    }
    return yaml.safe_dump(config_map, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    try:
        text = rendered(measure(args), args.configmap)
    except KVBridgeError as exc:
        print(f"kvbridge profile: error: {exc}", file=sys.stderr)
        return EXIT_INVALID if exc.code in ("PROFILE_NEEDS_VLLM", "PROFILE_OUTPUT") else EXIT_FAILED
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:  # measured, then the file could not be written: the profile is not lost
            print(f"kvbridge profile: error: PROFILE_OUTPUT (--output): cannot write it: {exc}", file=sys.stderr)
            sys.stdout.write(text)
            return EXIT_FAILED
        print(f"kvbridge profile: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK
