"""The ``kvbridge-router`` command (also ``python -m kvbridge_router``): flags generated from the settings (the
operator's ``api.router_settings``, from which the operator renders the router Deployment's flags).

Bad settings exit 2 with what to give, as do an unreadable token or API key file, no API to watch and a taken port;
SIGTERM and SIGINT stop it with 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge_operator.api.router_settings import API_KEYS_VARIABLE, RouterSettings, flag_of, settings, shown

if TYPE_CHECKING:
    import asyncio

PROG = "kvbridge-router"
EXIT_OK = 0
EXIT_INVALID = 2
DESCRIPTION = (
    "Routes /v1/completions and /v1/chat/completions (streaming passed through) to the pods a "
    "DisaggregatedDeployment's status lists, pairing only compatible ones; /v1/models, /health, /metrics."
)
HELP = "OpenAI-compatible front: each request to a prefill pod, then a decode pod paired with it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (router_settings.py), with its default and help."""
    for item, kind in settings():
        text = item.metadata["help"] + (f" (default {shown(item.default)})" if item.default != "" else "")
        options: dict[str, object] = {"dest": item.name, "default": item.default, "type": kind, "help": text}
        if item.metadata["metavar"]:
            options["metavar"] = item.metadata["metavar"]
        if issubclass(kind, StrEnum):
            options["choices"] = list(kind)
        parser.add_argument(flag_of(item), **options)  # type: ignore[arg-type]


#: the shortest key the replicas may sign their reports with
MIN_PEER_KEY_BYTES = 16


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def chosen(args: argparse.Namespace) -> RouterSettings:
    """The settings the parsed flags give."""
    return RouterSettings(**{item.name: getattr(args, item.name) for item, _ in settings()})


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """Route until SIGTERM or SIGINT; 2 (and why, on stderr) when it cannot start."""
    import asyncio
    import logging
    import signal

    from kvbridge_agent.core import KVBridgeError
    from kvbridge_agent.core.signing import load_token
    from kvbridge_operator.kube import KubeClient, connect
    from kvbridge_router.auth import ApiKeys
    from kvbridge_router.peering import PeersError
    from kvbridge_router.proxy import Router, RouterConfig, serve
    from kvbridge_router.source import follow_file, watch_status
    from kvbridge_router.tracing import Tracing

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    given = chosen(args)
    problems = given.problems()
    if problems:
        print(f"{prog}: error: {'; '.join(problems)}", file=sys.stderr)
        return EXIT_INVALID
    try:
        peer_key = read_peer_key(given.peer_key_file) if given.peer_key_file else b""
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        token = load_token(given.transfer_token_file) if given.transfer_token_file else b""
    except KVBridgeError as exc:
        print(f"{prog}: error: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    try:
        api_keys = ApiKeys.configured(given.api_key_file, os.environ, API_KEYS_VARIABLE)
    except KVBridgeError as exc:
        print(f"{prog}: error: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    if api_keys is not None:
        logging.getLogger(__name__).info("clients must send one of %d API keys (Authorization: Bearer)", len(api_keys))
    tracing = Tracing.from_environment(os.environ)
    try:
        router = Router(RouterConfig.of(given, token, api_keys, peer_key), tracing=tracing)
    except PeersError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if router.exchange is not None:
        logging.getLogger(__name__).info(
            "reporting to the other replicas (%s) every %g s", given.peers, given.peer_interval
        )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if given.status_file:
            source = follow_file(Path(given.status_file), router.set_pool, stop)
            await asyncio.gather(source, serve(router, given.host, given.port, stop))
            return
        connection = await connect(given.api_server, given.kubeconfig, given.context)
        namespace = given.namespace or pod_namespace()
        async with KubeClient(connection, user_agent="kvbridge-router") as client:
            source = watch_status(client, namespace, given.deployment, router.set_pool, stop)
            await asyncio.gather(source, serve(router, given.host, given.port, stop))

    try:
        with asyncio.Runner(loop_factory=fast_loop_factory()) as runner:
            runner.run(main())
    except KVBridgeError as exc:
        print(f"{prog}: error: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    except OSError as exc:  # the port is taken, or the address is not ours
        print(f"{prog}: error: cannot listen on {given.host}:{given.port}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        tracing.shutdown()  # the spans still batched go out
    return EXIT_OK


def read_peer_key(path: str) -> bytes:
    """The key in the file ``--peer-key-file`` names (its bytes, surrounding whitespace removed); ``ValueError``
    saying why when it cannot be read or is shorter than 16 bytes."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --peer-key-file {path}: {exc.strerror or exc}") from None
    if len(key) < MIN_PEER_KEY_BYTES:
        raise ValueError(
            f"--peer-key-file {path} holds {len(key)} bytes, at least {MIN_PEER_KEY_BYTES} are needed (the operator "
            "writes 64 hex characters into the <name>-router-peers Secret)"
        )
    return key


def fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (less CPU per routed request), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def pod_namespace() -> str:
    """The namespace the router runs in (its service account's), else default."""
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    try:
        return path.read_text(encoding="utf-8").strip() or "default"
    except OSError:
        return os.environ.get("POD_NAMESPACE", "default")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.func(args)
    return status
