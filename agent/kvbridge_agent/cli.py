"""The ``kvbridge-agent`` command line: serve, loopback, keys."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvbridge_agent.core import KVBridgeError, SpecError
from kvbridge_agent.core.contract import PairSpec, pair_from_spec, parse_environment

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2


def read_deployment(path: str) -> tuple[str, PairSpec]:
    """Name and transfer-relevant spec of the first DisaggregatedDeployment in a manifest file."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}", field=path, code="UNREADABLE") from exc
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}", field=path, code="BAD_YAML") from exc
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == "DisaggregatedDeployment":
            spec = document.get("spec")
            if not isinstance(spec, dict):
                raise SpecError(f"{path}: spec must be a mapping", field="spec", code="INVALID_SPEC")
            name = str((document.get("metadata") or {}).get("name") or "deployment")
            return name, pair_from_spec(spec)
    raise SpecError(f"{path}: no DisaggregatedDeployment document found", field=path, code="EMPTY")


def _scaled(pair: PairSpec, num_layers: int | None) -> PairSpec:
    if num_layers is None:
        return pair
    if num_layers < 1:
        raise SpecError("--num-layers must be at least 1", field="--num-layers", code="INVALID_SPEC")
    return pair.model_copy(update={"model": pair.model.model_copy(update={"num_layers": num_layers})})


def _serve(args: argparse.Namespace) -> int:
    from kvbridge_agent.synthetic.serve import serve

    overrides: dict[str, Any] = {
        "role": args.role,
        "engine_id": args.engine_id,
        "num_blocks": args.num_blocks,
        "http_port": args.http_port,
        "keys_dir": args.keys_dir,
        "device": args.device,
    }
    env = parse_environment(os.environ, **overrides)
    return serve(env, log_level=args.log_level)


def _loopback(args: argparse.Namespace) -> int:
    from kvbridge_agent.bench.loopback import loopback

    name, pair = read_deployment(args.file)
    pair = _scaled(pair, args.num_layers)
    report = loopback(
        name,
        pair,
        requests=args.requests,
        seed=args.seed,
        num_blocks=args.num_blocks,
        progress=not args.json,
        log_level=args.log_level,
    )
    result = report.to_dict()
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{name}: prefill TP {result['prefillRanks']} -> decode TP {result['decodeRanks']}: "
            f"{result['verifiedRequests']}/{result['requests']} requests verified, "
            f"{result['bytesTransferred']} bytes in {result['seconds']:.3f} s of transfers "
            f"({result['gbps']} GB/s), {result['descriptorsPerRequest']} descriptors per request"
        )
        for failure in result["failures"]:
            print(f"  FAILED {failure['request']}: {failure['code']}: {failure['message']}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _bench(args: argparse.Namespace) -> int:
    if args.layouts:
        return _bench_layouts(args)
    from kvbridge_agent.bench.measure import bench

    result = bench(requests=args.requests or 4, quick=args.quick)
    if args.plot:
        from kvbridge_agent.bench.plot import plot

        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return EXIT_OK
    print(
        f"memcpy {result['memcpyGBps']} GB/s, raw NIXL {result['nixlRawGBps']} GB/s (one descriptor), "
        f"handshake {result['handshakeMs']} ms, {result['seconds']} s"
    )
    print(
        "raw NIXL by descriptor size: "
        + ", ".join(f"{row['descriptorBytes'] >> 10} KiB {row['gbps']}" for row in result["descriptorSweep"])
    )
    print(
        f"{'configuration':<34} {'GB/s':>6} {'x raw':>6} {'x size':>6} {'descs':>7} {'B/desc':>8} "
        f"{'own us':>7} {'make us':>8} {'post us':>9}"
    )
    for row in result["results"]:
        print(
            f"{row['name']:<34} {row['gbps']:>6.2f} {row['ratioToRaw']:>6.2f} "
            f"{row['ratioToRawAtDescriptorSize']:>6.2f} {row['descriptorsPerRequest']:>7} "
            f"{row['bytesPerDescriptor']:>8} {row['overheadUsPerRequest']:>7.0f} {row['nixlMakeUsPerRequest']:>8.0f} "
            f"{row['nixlPostUsPerRequest']:>9.0f}"
        )
    for target in result["targets"]:
        print(
            f"{'met' if target['met'] else 'NOT met'}: {target['target']} (worst {target['worst']}: "
            f"{target['measured']})"
        )
    return EXIT_OK


def _bench_layouts(args: argparse.Namespace) -> int:
    import functools
    import importlib.util

    from kvbridge_agent.bench.layout_prefill import Allocate, own_views
    from kvbridge_agent.bench.layouts import bench_layouts, print_report

    device = args.device or "cpu"
    allocate: Allocate
    if importlib.util.find_spec("vllm") is not None:
        from kvbridge_agent.vllm_connector.host_cache import allocate_host_views

        allocate, allocator = functools.partial(allocate_host_views, device=device), "vLLM's allocate_kv_cache"
    elif device == "cpu":
        print(
            "kvbridge-agent bench --layouts: error: vLLM is not installed (its allocator builds the caches on "
            "host memory; --device cuda builds them with kvbridge's own views where vLLM is missing)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    else:
        allocate, allocator = functools.partial(own_views, device), "kvbridge's layout_views (equal to vLLM's, tested)"
    names = [name for name in (args.cases or "").split(",") if name]
    try:
        result = bench_layouts(
            allocate,
            requests=args.requests or (1 if args.zoo else 3),
            quick=args.quick,
            tokens=args.tokens,
            names=names,
            device=device,
            allocator=allocator,
            zoo=args.zoo,
        )
    except ValueError as exc:
        print(f"kvbridge-agent bench: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return EXIT_OK


def _keys(args: argparse.Namespace) -> int:
    from kvbridge_agent.transfer.keys import generate_keys

    keys = generate_keys(args.dir)
    print(f"wrote {args.dir}/curve-public and {args.dir}/curve-secret (public key {keys.public.decode()})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge-agent", description="The kvbridge in-pod agent.")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run one engine of the synthetic agent worker (the agent image)",
        description="Configured from the KVBRIDGE_* environment contract; flags win.",
    )
    serve.add_argument("--role", choices=["prefill", "decode"])
    serve.add_argument("--engine-id")
    serve.add_argument("--num-blocks", type=int)
    serve.add_argument("--http-port", type=int)
    serve.add_argument("--keys-dir")
    serve.add_argument("--device", help="cpu (default) or cuda")
    serve.add_argument("--log-level", default=argparse.SUPPRESS, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.set_defaults(func=_serve)

    loop = commands.add_parser("loopback", help="prefill and decode on 127.0.0.1 with real NIXL, every byte verified")
    loop.add_argument("-f", "--file", required=True, help="DisaggregatedDeployment manifest (the first is used)")
    loop.add_argument("--requests", type=int, default=16)
    loop.add_argument("--seed", type=int, default=0)
    loop.add_argument("--num-layers", type=int, help="scale the model down to this many layers")
    loop.add_argument("--num-blocks", type=int, default=64, help="KV blocks per rank (default 64)")
    loop.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    loop.add_argument("--log-level", default=argparse.SUPPRESS, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    loop.set_defaults(func=_loopback)

    bench = commands.add_parser(
        "bench",
        help="throughput against memcpy and raw NIXL, measured in one run",
        description="Throughput against memcpy and raw NIXL, measured in one run: by default every cache kind and TP "
        "pair through real engine processes; with --layouts every vLLM KVCacheLayout (LBHNC, LBNHC, LHBNC, BLHNC, "
        "BLNHC, BHLNC) on both sides plus heterogeneous pairs (TP 2->1, block 16->32, cross-order), on vLLM's own "
        "allocator in host memory, for Llama-3-8B and a 70B-class geometry (needs vllm).",
    )
    bench.add_argument(
        "--requests",
        type=int,
        help="requests per configuration (default 4; with --layouts 3 per block allocation, 1 with --zoo)",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="Split and CrossLayer at TP 1->1 only, short requests (with --layouts: Llama-3-8B, LBHNC, BLHNC and TP "
        "2->1, 512 tokens)",
    )
    bench.add_argument("--plot", metavar="PNG", help="also write the throughput figure (needs matplotlib)")
    bench.add_argument(
        "--layouts",
        action="store_true",
        help="per vLLM KVCacheLayout: descriptors per request, GB/s and fractions of raw NIXL and memcpy, targets",
    )
    bench.add_argument("--tokens", type=int, help="with --layouts: tokens per request (default 2048)")
    bench.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="with --layouts: where the caches live (default cpu; cuda: GPU memory, NIXL on VRAM)",
    )
    bench.add_argument(
        "--cases", metavar="NAMES", help="with --layouts: only these cases, comma-separated (e.g. BLHNC,LBHNC-tp2to1)"
    )
    bench.add_argument(
        "--zoo",
        action="store_true",
        help="with --layouts: the model zoo's families kvbridge accepts (tests/zoo: hybrid groups, MLA) instead of the "
        "Llama geometries; --cases names families, --tokens caps prompts (default 1024)",
    )
    bench.set_defaults(func=_bench)

    keys = commands.add_parser("keys", help="side-channel CURVE keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    generate = key_commands.add_parser("generate", help="write a fresh key pair")
    generate.add_argument("--dir", required=True)
    generate.set_defaults(func=_keys)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        status: int = args.func(args)
    except KVBridgeError as exc:
        field = f" [{exc.field}]" if exc.field and exc.field not in exc.message else ""
        print(f"kvbridge-agent {args.command}: error: {exc.code}: {exc.message}{field}", file=sys.stderr)
        return EXIT_INVALID if isinstance(exc, SpecError) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
