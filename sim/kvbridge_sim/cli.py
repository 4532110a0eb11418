"""The commands the simulation adds to ``kvbridge`` (entry points of group ``kvbridge.commands``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvbridge_agent.core import KVBridgeError
from kvbridge_operator.cli.main import EXIT_INCOMPATIBLE, EXIT_INVALID, EXIT_OK


def demo(args: argparse.Namespace) -> int:
    """``kvbridge demo`` (its arguments: kvbridge_operator.cli.main.build_parser)."""
    import asyncio
    import importlib.util

    needed = ("kmock", "torch", "nixl", "zmq") + (("vllm", "transformers") if args.engine == "vllm" else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"kvbridge demo: error: missing {', '.join(missing)}; install with "
            "pip install 'kvbridge[agent,operator,demo]' and vLLM's CPU build (or run make demo; "
            "--engine synthetic runs without vLLM)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    import signal

    from kvbridge_sim.demo import run_demo
    from kvbridge_sim.demo_report import render_text
    from kvbridge_sim.demo_wait import DemoError

    interrupted = asyncio.Event()
    if getattr(args, "serve", False):
        return _serve(args)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, interrupted.set)
        demo = asyncio.create_task(run_demo(args.file, args.requests, args.num_layers, interrupted, engine=args.engine))
        stopped = asyncio.create_task(interrupted.wait())
        await asyncio.wait({demo, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not demo.done():  # interrupted mid-request: cancel it; run_demo's cleanup stops every process it started
            demo.cancel()
        stopped.cancel()
        return await demo

    try:
        report = asyncio.run(main())
    except KVBridgeError as exc:
        print(f"kvbridge demo: error: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    except (DemoError, asyncio.CancelledError, KeyboardInterrupt) as exc:
        if interrupted.is_set() or not isinstance(exc, DemoError):
            print("kvbridge demo: interrupted; every process it started was stopped", file=sys.stderr)
            return 130
        print(f"kvbridge demo: failed: {exc}", file=sys.stderr)
        return EXIT_INCOMPATIBLE
    if args.json:
        print(json.dumps(report))
    else:
        print(render_text(report))
    return EXIT_OK if report["ok"] else EXIT_INCOMPATIBLE


def _serve(args: argparse.Namespace) -> int:
    """``kvbridge demo --serve``: until SIGINT/SIGTERM (kvbridge_sim.serve)."""
    import asyncio
    import signal

    from kvbridge_sim.demo_wait import DemoError
    from kvbridge_sim.serve import serve

    stop = asyncio.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(args.file, args.num_layers, args.engine, stop)

    try:
        asyncio.run(main())
    except KVBridgeError as exc:
        print(f"kvbridge demo: error: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    except (DemoError, asyncio.CancelledError, KeyboardInterrupt) as exc:
        if not stop.is_set():
            print(f"kvbridge demo: failed: {exc}", file=sys.stderr)
            return EXIT_INCOMPATIBLE
    print("kvbridge demo: stopped; every process it started was stopped", file=sys.stderr)
    return EXIT_OK
