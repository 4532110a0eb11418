"""``kvbridge profile`` against real vLLM engines (the CPU build, the tiny local model), not a test.

    .venv/bin/python benchmarks/profile_vllm.py [--concurrencies 1,4,8] [--prompt-tokens 256] [--itl-percentile 95]
        [--json]

Starts one prefill and one decode engine exactly as the operator renders a deployment with kvbridge's connector
(each pod its own loopback address and core), runs ``kvbridge profile`` against them — vLLM's own ``vllm bench
serve`` for every point — and prints the profile and how long it took; then stops the engines. The profile is what
the planner would read for this model on this machine (docs/autoscaling.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbridge_agent.core import Role
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_sim import tiny_model
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines, deployment, rendered_template

ROOT = Path(__file__).parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrencies", default="1,4,8", help="decode concurrencies (default 1,4,8)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prefill prompt tokens (default 256)")
    parser.add_argument("--context-tokens", type=int, default=256, help="decode context tokens (default 256)")
    parser.add_argument("--output-tokens", type=int, default=32, help="decode tokens per request (default 32)")
    parser.add_argument(
        "--itl-percentile", type=float, default=95, help="the ITL points' percentile (default 95, the spec's default)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbridge-profile-") as folder:
        workdir = Path(folder)
        model = tiny_model.make(workdir / "tiny-llama")
        keys = workdir / "keys"
        generate_keys(keys)
        document = deployment("tiny-profile", 1, connector="KVBridge", verification="All")
        engines = Engines(workdir / "engines", model)
        env = {"KVBRIDGE_KEYS_DIR": str(keys)}
        prefill = engines.add("prefill", rendered_template(document, Role.PREFILL), "127.0.2.2", (0,), env=env)
        decode = engines.add("decode", rendered_template(document, Role.DECODE), "127.0.2.5", (1,), env=env)
        try:
            print("starting a prefill and a decode engine (vLLM's CPU build) ...", file=sys.stderr, flush=True)
            engines.start(["prefill", "decode"])
            started = time.monotonic()
            command = [
                *(sys.executable, "-m", "kvbridge_operator", "profile"),
                *("--prefill-url", prefill.url, "--decode-url", decode.url),
                *("--model", MODEL_NAME, "--tokenizer", str(model)),
                *("--engine", "tiny Llama (2 layers), vLLM 0.32 CPU build, 1 core per engine"),
                *("--prompt-tokens", str(args.prompt_tokens), "--prefill-prompts", "32"),
                *("--prefill-concurrency", "8", "--context-tokens", str(args.context_tokens)),
                *("--output-tokens", str(args.output_tokens), "--concurrencies", args.concurrencies),
                *("--itl-percentile", str(args.itl_percentile)),
                *("--vllm", str(Path(sys.executable).parent / "vllm"), "--timeout", "600"),
            ]
            finished = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
            if finished.returncode != 0:
                print(f"kvbridge profile exited with {finished.returncode}", file=sys.stderr)
                return 1
            profile = json.loads(finished.stdout)
        finally:
            engines.stop()
    result = {
        "profile": profile,
        "engineStartSeconds": engines.start_seconds,
        "profileSeconds": round(time.monotonic() - started, 1),
        "seconds": round(time.monotonic() - began, 1),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
