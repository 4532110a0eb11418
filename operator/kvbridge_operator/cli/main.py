"""The ``kvbridge`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvbridge_agent.core import KVBridgeError
from kvbridge_operator import __version__
from kvbridge_operator.api.names import KIND
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.children import placement
from kvbridge_operator.cli import profile as profile_cli
from kvbridge_operator.cli.arguments import at_least
from kvbridge_operator.cli.manifests import read_documents, source_name
from kvbridge_operator.cli.plan_report import (
    DocumentPlan as PlannedDocument,
)
from kvbridge_operator.cli.plan_report import (
    entries,
    invalid_entry,
    plan_document,
    render_text,
    selected_ranks,
)

EXIT_OK = 0
EXIT_INCOMPATIBLE = 1
EXIT_INVALID = 2
#: the reader of stdout went away (``| head``): what a shell reports for a command SIGPIPE ended (128 + 13)
EXIT_CLOSED_PIPE = 141


def _plan(args: argparse.Namespace) -> int:
    """Plan every valid document; report each invalid one on stderr without hiding the others' verdicts."""
    try:
        read = read_documents(args.file)
    except KVBridgeError as exc:
        print(f"kvbridge plan: error: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    documents, invalid = [], 0
    order: list[PlannedDocument | Obj] = []  # in input order: a planned document, or an invalid one's entry
    for item in read:
        for warning in item.warnings:
            print(f"kvbridge plan: warning: {item.label}: {warning}", file=sys.stderr)
        if item.skipped:
            print(f"kvbridge plan: {item.label}: skipped, not a {KIND} ({item.skipped})", file=sys.stderr)
        elif item.error is not None:
            invalid += 1
            field = f" [{item.error.field}]" if item.error.field and item.error.field not in item.error.message else ""
            print(f"kvbridge plan: error: {item.error.message}{field}", file=sys.stderr)
            order.append(invalid_entry(item.label, item.name, item.error))
        elif item.deployment is not None:
            planned = plan_document(
                placement.with_gpus_per_node(item.deployment, args.gpus_per_node), warnings=item.warnings
            )
            documents.append(planned)
            order.append(planned)
            if args.json:  # the text report prints them with the plan; JSON readers see them on stderr too
                for advisory in planned.advisories:
                    print(
                        f"kvbridge plan: warning: {item.label}: {advisory.code} at {advisory.field}: "
                        f"{advisory.message}",
                        file=sys.stderr,
                    )
    if not documents and not invalid:
        print(f"kvbridge plan: error: {source_name(args.file)}: no {KIND} documents found", file=sys.stderr)
        return EXIT_INVALID
    try:
        ranks = [selected_ranks(doc, args.decode_rank, args.all_ranks) for doc in documents]
    except KVBridgeError as exc:
        print(f"kvbridge plan: error: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    if args.json and order:
        planned_ranks = iter(ranks)  # the planned documents come in `order` as in `documents`
        out = [
            entry
            for item in order
            for entry in (entries(item, next(planned_ranks)) if isinstance(item, PlannedDocument) else [item])
        ]
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif documents:
        print("\n\n".join(render_text(doc, r) for doc, r in zip(documents, ranks, strict=True)))
    if invalid:
        return EXIT_INVALID
    return EXIT_OK if all(doc.compatible for doc in documents) else EXIT_INCOMPATIBLE


def _model(args: argparse.Namespace) -> int:
    import yaml

    from kvbridge_operator.cli.hf_config import geometry, model_block, model_name, read_config

    try:
        config = read_config(Path(args.path))
        found = geometry(config, args.name or model_name(Path(args.path), config))
    except KVBridgeError as exc:
        print(f"kvbridge model: error: {exc.message}", file=sys.stderr)
        return EXIT_INVALID

    class Dumper(yaml.SafeDumper):
        """Lists in flow style (``layerTypes: [Sliding, Full, ...]``), maps as blocks."""

    Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, True))
    sys.stdout.write(yaml.dump({"model": model_block(found)}, Dumper=Dumper, sort_keys=False, width=118))
    return EXIT_OK


def _crd(args: argparse.Namespace) -> int:
    from kvbridge_operator.api.crd import files

    rendered = files()
    if args.output is None:
        sys.stdout.write("---\n".join(rendered.values()))
        return EXIT_OK
    for directory in args.output:
        for name, text in rendered.items():
            path = Path(directory) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
    return EXIT_OK


def _operator_run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from kvbridge_operator.config import from_flags
    from kvbridge_operator.controller.handlers import run_operator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = from_flags(args)
    except KVBridgeError as exc:
        print(f"kvbridge operator run: error: {exc.message}", file=sys.stderr)
        return EXIT_INVALID

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_operator(config, stop)

    try:
        asyncio.run(main())
    except KVBridgeError as exc:  # no API to talk to (no kubeconfig, a bad one, no such context): say so, no trace
        if exc.code not in ("NO_API_SERVER", "BAD_KUBECONFIG"):
            raise
        print(f"kvbridge operator run: error: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


#: commands other packages of the distribution contribute (``kvbridge demo``: kvbridge_sim, a checkout's sim/), found
#: through entry points so that the operator never imports them and an image without them still runs
COMMANDS_GROUP = "kvbridge.commands"


def _contributed(name: str) -> Callable[[argparse.Namespace], int] | None:
    from importlib.metadata import entry_points

    for entry in entry_points(group=COMMANDS_GROUP, name=name):
        try:
            command: Callable[[argparse.Namespace], int] = entry.load()
        except ImportError:
            return None
        return command
    return None


def _demo(args: argparse.Namespace) -> int:
    command = _contributed("demo")
    if command is None:
        print(
            "kvbridge demo: error: this installation has no kvbridge_sim (the emulated cluster the demo runs on); "
            "run the demo from a checkout: make demo",
            file=sys.stderr,
        )
        return EXIT_INVALID
    return command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description="Prefill/decode disaggregation on Kubernetes.")
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan(commands)

    model = commands.add_parser(
        "model", help="print the spec.model block of a Hugging Face model from its config.json (file or folder)"
    )
    model.add_argument("path", help="config.json, or a model folder that contains it")
    model.add_argument("--name", help="spec.model.name (default: the config's _name_or_path or the folder name)")
    model.set_defaults(func=_model)

    crd = commands.add_parser("crd", help="print or write the CustomResourceDefinition generated from the models")
    crd.add_argument("-o", "--output", action="append", metavar="DIR", help="write into DIR (repeatable)")
    crd.set_defaults(func=_crd)

    profile = commands.add_parser(
        "profile",
        help=profile_cli.HELP,
        description=f"{profile_cli.HELP[0].upper()}{profile_cli.HELP[1:]}. Exit status: 0 the profile was written, "
        "1 a bench run failed or timed out (or the profile could not be written: it is printed instead), 2 invalid "
        "arguments, an unwritable output folder or no vllm to run, checked before the first run.",
    )
    profile_cli.add_arguments(profile)
    profile.set_defaults(func=profile_cli.run)

    _add_operator(commands)
    _add_demo(commands)
    return parser


def _add_plan(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser(
        "plan",
        help="check whether prefill and decode settings can exchange KV caches, and how",
        description="Check DisaggregatedDeployment documents without a cluster: what each role runs (engine and "
        "image), whether the two roles can exchange KV and how, and what has been run for real of the "
        "configuration. Exit status: 0 all compatible, 1 any incompatible, 2 unreadable or invalid input.",
    )
    plan.add_argument(
        "-f", "--file", required=True, help="manifest file (multi-document YAML), a folder of them, or - for stdin"
    )
    ranks = plan.add_mutually_exclusive_group()
    ranks.add_argument("--decode-rank", type=int, metavar="R", help="plan decode rank R (default 0)")
    ranks.add_argument("--all-ranks", action="store_true", help="plan every decode rank of every document")
    plan.add_argument("--json", action="store_true", help="print one JSON document (a list) on stdout")
    plan.add_argument(
        "--gpus-per-node",
        type=at_least(1),
        default=0,
        metavar="N",
        help="GPUs one node of the cluster offers (the operator's --gpus-per-node), for documents "
        "without spec.placement.gpusPerNode: a role whose engine cannot fit one is refused",
    )
    plan.set_defaults(func=_plan)


def _add_operator(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvbridge_operator.config import default_of, flag_of, former_flags, settings, variable_of

    operator = commands.add_parser("operator", help="the Kopf operator for DisaggregatedDeployments")
    operator_commands = operator.add_subparsers(dest="operator_command", required=True, metavar="ACTION")
    run = operator_commands.add_parser(
        "run",
        help="run the operator (settings from flags or KVBRIDGE_OPERATOR_* variables)",
        description="Watches DisaggregatedDeployments and their pods; one replica.",
    )
    for item in settings():  # one flag per setting, generated: the flags and the variables never drift apart
        default = default_of(item)
        metavar = flag_of(item).rsplit("-", 1)[-1].upper()
        shown = ",".join(default) if isinstance(default, tuple) else default
        former = "".join(f"; {flag} is its former name (deprecated)" for flag in former_flags(item))
        text = f"{item.metadata['help']} (default {shown!r}; {variable_of(item)}{former})"
        flags = [flag_of(item), *former_flags(item)]
        if item.type in (bool, "bool"):
            run.add_argument(*flags, dest=item.name, action="store_true", default=None, help=text)
        elif "tuple" in str(item.type):
            run.add_argument(*flags, dest=item.name, action="append", metavar=metavar, help=text)
        else:
            kind = int if "int" in str(item.type) else str
            run.add_argument(*flags, dest=item.name, type=kind, metavar=metavar, help=text)
    run.set_defaults(func=_operator_run)


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="the whole system on one machine: emulated API, operator, local pods, real KV transfers",
        description="Exit status 0 only if every compatible deployment became Ready and every transfer verified "
        "(also after a prefill restart), and every incompatible one was reported as such.",
    )
    demo.add_argument("-f", "--file", action="append", help="manifest(s) to apply (default: two examples)")
    demo.add_argument(
        "--engine",
        choices=("vllm", "synthetic", "agent"),
        default="vllm",
        help="vllm (default): real vLLM (CPU build) with a tiny local model, decode's tokens checked "
        "against a single engine; synthetic: kvbridge's synthetic engine, every byte checked (fast); agent: "
        "synthetic's former name (deprecated)",
    )
    demo.add_argument("--requests", type=int, default=8, help="requests per compatible deployment (default 8)")
    demo.add_argument(
        "--num-layers", type=int, default=4, help="synthetic engines: scale models down to this many layers (default 4)"
    )
    demo.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    demo.add_argument(
        "--serve",
        action="store_true",
        help="keep the cluster up instead: print a kubeconfig for the emulated API and each router's "
        "URL for your own clients (curl, the OpenAI SDK, vllm bench serve, kubectl); Ctrl-C stops "
        "everything",
    )
    demo.set_defaults(func=_demo)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop quietly with the status a command SIGPIPE ends has, never the
        # status of an invalid input (the input was fine, and what was read of the output is correct)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps interpreter shutdown from failing again
        return EXIT_CLOSED_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
