"""``kvbridge demo``: the whole system on one machine, no cluster.

An emulated Kubernetes API, the operator, a local pod runner (a stand-in for
the StatefulSet controller and kubelet), two example deployments (one
compatible, one incompatible), and real KV transfers through the published
endpoints — including across a prefill pod restart. By default the pods run
real vLLM (its CPU build, a tiny model made locally) and decode's greedy
tokens are checked against a single engine; ``--engine agent`` runs
kvbridge's synthetic engine instead and checks every byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvbridge_operator.api.names import LABEL_DEPLOYMENT
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.cli.manifests import deployments_of, parse_documents, read_text, source_name
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.kube import DEPLOYMENTS, PODS, KubeClient
from kvbridge_router.proxy import Router
from kvbridge_sim.support import free_port, until

#: the demo's own manifests (package data: byte copies of examples/vllm/tiny-cpu.yaml and examples/*.yaml, kept
#: equal by a test), so the demo runs wherever kvbridge_sim is installed, not only from a checkout
MANIFESTS = Path(__file__).resolve().parent / "manifests"
DEFAULT_FILES = {
    "vllm": ("tiny-cpu.yaml", "incompatible-replicated-heads.yaml"),
    "agent": ("llama3-8b-hetero-tp.yaml", "incompatible-replicated-heads.yaml"),
}
#: greedy tokens decode generates per request (compared with a single engine)
VLLM_MAX_TOKENS = 12
NAMESPACE = "default"


class DemoError(Exception):
    pass


@dataclass
class Transfers:
    requests: int = 0
    verified: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: list[dict[str, str]] = field(default_factory=list)
    after_restart: int = 0
    #: what "verified" means: every byte decode received (agent engines), or decode's tokens (vLLM)
    check: str = "bytes"
    #: whether a prefill pod was killed and restarted halfway
    restarted: bool = True
    #: the request sent right after the kill: its HTTP status, how long it took, the error code
    during_outage: dict[str, Any] = field(default_factory=dict)
    #: the router's own figures (requests by outcome, retries, overhead)
    router: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests,
            "verified": self.verified,
            "check": self.check,
            "verifiedAfterPrefillRestart": self.after_restart,
            "failures": self.failures,
            "duringOutage": self.during_outage,
            "router": self.router,
        }
        if self.check == "bytes":
            out["gbps"] = round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0
        else:
            out["meanRequestSeconds"] = round(self.seconds / self.verified, 3) if self.verified else 0.0
        return out


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_vllm(document: Obj) -> bool:
    return bool(((document.get("spec") or {}).get("engine") or {}).get("kind", "VLLM") == "VLLM")  # VLLM: the default


def documents(files: list[str] | None, num_layers: int, engine: str = "vllm") -> list[Obj]:
    """The manifests to apply; agent-engine models scaled down to ``num_layers`` so the demo fits this machine
    (vLLM engines serve a real model, whose geometry the spec must state as it is)."""
    paths = files or [str(MANIFESTS / name) for name in DEFAULT_FILES[engine]]
    found: list[Obj] = []
    for path in paths:
        source = source_name(path)
        parsed = parse_documents(read_text(path), source)  # read once: stdin cannot be read twice
        deployments_of(parsed, source)  # the same validation as `kvbridge plan`: valid documents only
        for document in parsed:
            if document:
                scaled = copy.deepcopy(document)
                if not is_vllm(scaled):
                    model = scaled["spec"]["model"]
                    model["numLayers"] = min(int(model["numLayers"]), num_layers)
                found.append(scaled)
    return found


def condition(obj: Obj, kind: str) -> Obj:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


async def wait_for_verdicts(
    client: KubeClient, names: list[str], timeout: float, interrupted: asyncio.Event | None = None
) -> dict[str, Obj]:
    last = ""
    objects: dict[str, Obj] = {}

    async def settled() -> bool:
        nonlocal last, objects
        check(interrupted)
        objects = {n: await client.get(DEPLOYMENTS, NAMESPACE, n) or {} for n in names}
        line = "; ".join(
            f"{n}: {_short(condition(o, 'Ready').get('message') or 'waiting for the operator')}"
            for n, o in objects.items()
        )
        if line != last:
            progress(f"  {line}")
            last = line
        return all(
            condition(o, "Compatible").get("status") == "False" or condition(o, "Ready").get("status") == "True"
            for o in objects.values()
        )

    try:
        await until(settled, timeout, "every deployment compatible and Ready, or incompatible", interval=0.5)
    except TimeoutError as exc:
        raise DemoError(f"not settled after {timeout:g} s: {last}") from exc
    return objects


def _short(message: str, limit: int = 100) -> str:
    """One status message in a progress line (the full text is in the report and the events)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


@dataclass
class LocalRouter:
    """``kvbridge router`` for one deployment, in this process: the code the router Deployment runs
    (spec.router), watching the deployment's status on the emulated API and serving on 127.0.0.1."""

    router: Router
    url: str
    stop: asyncio.Event
    tasks: list[asyncio.Task[None]]

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), timeout=30)


async def start_router(client: KubeClient, name: str, timeout: float = 60) -> LocalRouter:
    """A router in this process for deployment ``name``, set as its spec says (policy, prefill block size)."""
    from kvbridge_operator.api.spec import parse_deployment
    from kvbridge_router.proxy import Router, RouterConfig, serve
    from kvbridge_router.source import watch_status
    from kvbridge_sim.runner import router_token

    spec = parse_deployment(await client.get(DEPLOYMENTS, NAMESPACE, name) or {}).spec
    token = await router_token(client, NAMESPACE, name) if spec.router.enabled and spec.router.sign_transfers else b""
    config = RouterConfig(policy=spec.router.policy.value, block_tokens=spec.prefill.block_size, transfer_token=token)
    router, stop = Router(config), asyncio.Event()
    port = free_port()
    tasks = [
        asyncio.create_task(watch_status(client, NAMESPACE, name, router.set_pool, stop)),
        asyncio.create_task(serve(router, "127.0.0.1", port, stop)),
    ]
    local = LocalRouter(router, f"http://127.0.0.1:{port}", stop, tasks)
    try:
        await until(lambda: not router.pool.problem(), timeout, f"{name}'s router to find pods", interval=0.2)
    except TimeoutError as exc:
        await local.close()
        raise DemoError(f"{name}: the router found nothing to route to: {router.pool.problem()}") from exc
    return local


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One request through the router: the HTTP status and the JSON answer (or an error of the router's shape)."""
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, {"error": {"code": "ROUTER_UNREACHABLE", "message": f"{type(exc).__name__}: {exc}"}}
    try:
        answer = json.loads(text)
    except ValueError:
        answer = {"error": {"code": "NOT_JSON", "message": text[:300]}}
    return response.status, answer if isinstance(answer, dict) else {"error": {"code": "NOT_JSON", "message": ""}}


def _failure(request: str, status: int, answer: dict[str, Any]) -> dict[str, str]:
    error = answer.get("error") or {}
    return {
        "request": request,
        "code": str(error.get("code") or f"HTTP_{status}"),
        "message": str(error.get("message") or answer)[:500],
    }


async def route(
    client: KubeClient, runner: Any, name: str, requests: int, restart: bool, interrupted: asyncio.Event | None = None
) -> Transfers:
    """Requests through the router to the synthetic engines, every byte checked; halfway a prefill pod is killed:
    the request sent at once goes to the other prefill pod (or fails with a clear 5xx), the rest after it is back."""
    result = Transfers()
    dd = await client.get(DEPLOYMENTS, NAMESPACE, name) or {}
    block = max(
        int(dd["spec"].get("prefill", {}).get("blockSize", 16)), int(dd["spec"].get("decode", {}).get("blockSize", 16))
    )
    local = await start_router(client, name)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for index in range(requests):
                check(interrupted)
                if restart and index == requests // 2:
                    await _kill_prefill(client, runner, name, local, session, result, interrupted, {"prompt": [1] * 8})
                tokens = [3 * block + 5, 1, 7 * block, 2 * block + 1][index % 4]
                result.requests += 1
                status, answer = await send(
                    session, local.url, {"model": "demo", "prompt": [7] * tokens, "max_tokens": 1}
                )
                moved = answer.get("kvbridge") or {}
                ok = status == 200 and moved.get("verified") is True
                if ok:
                    result.verified += 1
                    result.bytes += int(moved["bytes"])
                    result.seconds += float(moved["transferSeconds"])
                    result.after_restart += int(restart and index >= requests // 2)
                else:
                    result.failures.append(_failure(f"{name}-{index}", status, answer))
                progress(
                    f"  {name} request {index + 1}/{requests} via the router: "
                    f"{'verified' if ok else result.failures[-1]['code']}"
                )
    finally:
        await local.close()
    result.router = local.router.metrics.summary()
    return result


async def _kill_prefill(
    client: KubeClient,
    runner: Any,
    name: str,
    local: LocalRouter,
    session: aiohttp.ClientSession,
    result: Transfers,
    interrupted: asyncio.Event | None,
    probe: dict[str, Any],
) -> None:
    """Kill a prefill pod's engine, send one request at once (the status may still list the dead pod), wait until
    the pod is back, and let the router see it."""
    victim = sorted(t.pod for t in local.router.pool.prefill)[0]
    progress(f"  killing prefill pod {victim}'s engine (the runner restarts it, as a kubelet would)")
    runner.crash(NAMESPACE, victim)
    started = time.monotonic()
    status, answer = await send(session, local.url, probe)
    seconds = round(time.monotonic() - started, 2)
    outcome = "answered" if status == 200 else f"{status} {(answer.get('error') or {}).get('code', '')}"
    result.during_outage = {
        "status": status,
        "seconds": seconds,
        "code": "" if status == 200 else _failure("outage", status, answer)["code"],
    }
    progress(
        f"  a request sent right after the kill: {outcome} in {seconds} s (another prefill pod, or a clear "
        "error; never a hang)"
    )
    await wait_restarted(client, name, victim, timeout=600, interrupted=interrupted)
    with contextlib.suppress(TimeoutError):  # at most 30 s, then the demo goes on
        await until(
            lambda: victim in {t.pod for t in local.router.pool.routable()},
            30,
            f"{victim} routable again",
            interval=0.2,
        )
    progress(f"  {victim} is back with a new engine: decode handshakes with it again")


async def wait_restarted(
    client: KubeClient, name: str, pod: str, timeout: float = 120, interrupted: asyncio.Event | None = None
) -> None:
    seen_down = False

    async def back() -> bool:
        nonlocal seen_down
        check(interrupted)
        dd = await client.get(DEPLOYMENTS, NAMESPACE, name) or {}
        pods = [e["pod"] for e in (dd.get("status") or {}).get("prefill", {}).get("endpoints") or []]
        seen_down = seen_down or pod not in pods
        return seen_down and pod in pods and condition(dd, "Ready").get("status") == "True"

    try:
        await until(back, timeout, f"{pod} to come back", interval=0.3)
    except TimeoutError as exc:
        raise DemoError(f"{pod} did not come back within {timeout:g} s") from exc


async def route_vllm(
    client: KubeClient, runner: Any, name: str, requests: int, model: str, interrupted: asyncio.Event | None = None
) -> Transfers:
    """Requests through the router to vLLM pods: prefill computes, decode pulls the KV cache over NIXL and
    generates; every answer is compared with a single-engine run of the same prompt on the decode pod. Halfway a
    prefill pod's engine is killed; a request sent at once fails with a clear 5xx (this deployment has one
    prefill pod) and the rest go on once the runner has restarted it (decode meets a new engine id)."""
    from kvbridge_sim import pd_requests

    dd = await client.get(DEPLOYMENTS, NAMESPACE, name) or {}
    block = int(dd["spec"].get("decode", {}).get("blockSize", 32))
    restart = requests >= 2
    result = Transfers(check="tokens", restarted=restart)
    local = await start_router(client, name)
    try:
        async with pd_requests.client_session(300) as session:
            for index in range(requests):
                check(interrupted)
                if restart and index == requests // 2:
                    probe = {"model": model, "prompt": tiny_model_prompt(8, salt=99), "max_tokens": 1}
                    await _kill_prefill(client, runner, name, local, session, result, interrupted, probe)
                tokens = [3 * block + 5, 7, 2 * block, block + 1][index % 4]
                prompt = tiny_model_prompt(tokens, salt=index)
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": VLLM_MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                result.requests += 1
                started = time.perf_counter()
                status, answer = await send(session, local.url, body)
                seconds = time.perf_counter() - started
                decode_url = next(iter(t.url for t in local.router.pool.decode), "")
                if status != 200 or not decode_url:
                    result.failures.append(_failure(f"{name}-{index}", status, answer))
                    progress(f"  {name} request {index + 1}/{requests}: {result.failures[-1]['code']}")
                    continue
                got = list(answer["choices"][0]["token_ids"])
                try:
                    want = await pd_requests.baseline(
                        session, decode_url, model, prompt, VLLM_MAX_TOKENS, salt=f"demo-baseline-{index}"
                    )
                except (pd_requests.PDRequestError, aiohttp.ClientError, TimeoutError) as exc:
                    result.failures.append(
                        {"request": f"{name}-{index}", "code": "BASELINE_FAILED", "message": str(exc)}
                    )
                    continue
                if got == want.tokens:
                    result.verified += 1
                    result.seconds += seconds
                    result.after_restart += int(restart and index >= requests // 2)
                    outcome = f"{tokens} prompt tokens, decode's {len(got)} tokens equal a single engine's"
                else:
                    result.failures.append(
                        {
                            "request": f"{name}-{index}",
                            "code": "TOKENS_DIFFER",
                            "message": f"P/D {got} != single engine {want.tokens}",
                        }
                    )
                    outcome = "TOKENS_DIFFER"
                progress(f"  {name} request {index + 1}/{requests} via the router: {outcome}")
    finally:
        await local.close()
    result.router = local.router.metrics.summary()
    return result


def tiny_model_prompt(length: int, salt: int) -> list[int]:
    from kvbridge_sim.tiny_model import prompt

    return prompt(length, salt=1000 + salt)


def events_of(api: Any, name: str) -> list[Obj]:
    return [
        {
            "object": f"DisaggregatedDeployment/{e['involvedObject']['name']}",
            "type": e["type"],
            "reason": e["reason"],
            "message": e["message"],
        }
        for e in api.objects_of("events")
        if e.get("involvedObject", {}).get("name") == name
    ]


def check(interrupted: asyncio.Event | None) -> None:
    if interrupted is not None and interrupted.is_set():
        raise DemoError("interrupted")


def synthetic_deployment(name: str) -> Obj:
    """2 prefill + 2 decode synthetic-engine pods on CPU (a small model, a 20 s lease, a 5 s drain): the
    deployment the day-2 test and benchmarks/chaos_under_load.py run operations on under load."""
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": name},
        "spec": {
            "engine": {"kind": "Agent", "device": "CPU"},
            "model": {"name": "m", "numLayers": 2, "numKVHeads": 4, "headDim": 64},
            "transfer": {"leaseSeconds": 20, "drainSeconds": 5},
            "prefill": {"replicas": 2, "blockSize": 16},
            "decode": {"replicas": 2, "blockSize": 16},
        },
    }


def models_for(docs: list[Obj], workdir: Path) -> dict[str, str]:
    """The local model folder for each model name the vLLM documents serve (the tiny model, and the small one
    where a document names it: made here)."""
    if not any(is_vllm(d) for d in docs):
        return {}
    from kvbridge_sim import tiny_model

    named = {str(((d.get("spec") or {}).get("model") or {}).get("name", "")) for d in docs if is_vllm(d)}
    folders = {}
    for shape in (s for s in tiny_model.SHAPES.values() if s is tiny_model.TINY or s.name in named):
        progress(f"making {shape.name} (random weights, a tokenizer trained here) ...")
        folders[shape.name] = str(tiny_model.make(workdir / shape.name.split("/")[-1], shape))
    return folders


@dataclass
class LocalCluster:
    """The emulated API, its client and the local kubelet (the operator runs beside them)."""

    api: Any
    url: str
    client: KubeClient
    runner: Any


@contextlib.asynccontextmanager
async def local_cluster(
    workdir: Path, models: dict[str, str], interrupted: asyncio.Event | None
) -> AsyncIterator[LocalCluster]:
    """The emulated API, the operator (in this process) and the local kubelet, started in that order; on exit the
    pods end first (engines drain on SIGTERM), then the operator (Kopf's exit cancels what still runs).
    ``interrupted`` is set on SIGINT/SIGTERM (after the operator started: Kopf installs its own handlers)."""
    from kvbridge_operator.controller.handlers import run_operator
    from kvbridge_sim.local_api import emulated_api, stop_operator_beside
    from kvbridge_sim.runner import LocalRunner

    async with emulated_api() as (api, url, client):
        config = OperatorConfig(api_server=url, cpu_mode=True, agent_num_blocks=96, liveness_port=0)
        stop, ready = asyncio.Event(), asyncio.Event()
        operator = asyncio.create_task(run_operator(config, stop, ready_flag=ready))
        await asyncio.wait_for(ready.wait(), timeout=60)
        await asyncio.sleep(0.2)  # Kopf installs its own SIGINT/SIGTERM handlers: ours must win
        if interrupted is not None:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, interrupted.set)
        runner, runner_stop = LocalRunner(client, workdir, models=models), asyncio.Event()
        api.pod_logs = runner.pod_log  # kubectl logs reads what the local kubelet keeps
        running = asyncio.create_task(runner.run(runner_stop))
        try:
            yield LocalCluster(api, url, client, runner)
        finally:
            runner_stop.set()
            await running
            await runner.close()
            await stop_operator_beside(url, operator, stop, timeout=30)


async def apply_all(client: KubeClient, docs: list[Obj]) -> list[str]:
    """Create each DisaggregatedDeployment; their names."""
    names = []
    for doc in docs:
        await client.create(DEPLOYMENTS, NAMESPACE, doc)
        names.append(doc["metadata"]["name"])
        progress(f"applied DisaggregatedDeployment {doc['metadata']['name']}")
    return names


async def run_demo(
    files: list[str] | None,
    requests: int,
    num_layers: int,
    interrupted: asyncio.Event | None = None,
    engine: str = "vllm",
) -> dict[str, Any]:
    docs = documents(files, num_layers, engine)
    vllm_docs = [d for d in docs if is_vllm(d)]
    progress(
        "kvbridge demo — everything on this machine: an emulated Kubernetes API, the operator, and a local "
        "stand-in for the StatefulSet controller and kubelet (pods are local processes on 127.0.0.N; not a "
        "cluster). "
        + (
            "vLLM pods run vLLM's CPU build with a tiny model made locally; starting them takes a minute or two."
            if vllm_docs
            else f"Models scaled to at most {num_layers} layers."
        )
    )
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as workdir:
        models = models_for(docs, Path(workdir))
        async with local_cluster(Path(workdir), models, interrupted) as cluster:
            api, client, runner = cluster.api, cluster.client, cluster.runner
            try:
                names = await apply_all(client, docs)
                objects = await wait_for_verdicts(client, names, 900 if vllm_docs else 150, interrupted)
                report: dict[str, Any] = {"ok": True, "deployments": [], "events": []}
                for name in names:
                    obj = objects[name]
                    entry: dict[str, Any] = {
                        "name": name,
                        "ready": _ready_columns(obj),
                        "conditions": {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions", [])},
                        "plan": (obj.get("status") or {}).get("plan"),
                        "endpoints": (obj.get("status") or {}).get("prefill", {}).get("endpoints") or [],
                    }
                    if condition(obj, "Compatible").get("status") == "True":
                        progress(f"routing {requests} requests through {name} ...")
                        if is_vllm(obj):
                            model = obj["spec"]["model"]["name"]  # the served name, as clients of a cluster send
                            transfers = await route_vllm(client, runner, name, requests, model, interrupted)
                        else:
                            transfers = await route(client, runner, name, requests, True, interrupted)
                        await asyncio.sleep(1.0)  # let the operator publish the last pod events
                        entry["transfers"] = transfers.to_dict()
                        final = await client.get(DEPLOYMENTS, NAMESPACE, name) or obj
                        entry["conditions"] = {c["type"]: c["status"] for c in final["status"]["conditions"]}
                        entry["endpoints"] = final["status"]["prefill"].get("endpoints") or []
                        entry["ready"] = _ready_columns(final)
                        report["ok"] &= (
                            transfers.verified == transfers.requests
                            and (transfers.after_restart > 0 or not transfers.restarted)
                            and entry["conditions"].get("Ready") == "True"
                        )
                    else:
                        pods = await client.list(PODS, NAMESPACE, f"{LABEL_DEPLOYMENT}={name}")
                        entry["pods"] = len(pods)
                        report["ok"] &= not pods and condition(obj, "Compatible").get("reason") == "Incompatible"
                    report["deployments"].append(entry)
                    report["events"] += events_of(api, name)
                restarted = any(e["reason"] == "PrefillRestarted" for e in report["events"])
                report["ok"] &= restarted or not any(
                    d.get("transfers", {}).get("verifiedAfterPrefillRestart") for d in report["deployments"]
                )
                if not report["ok"]:
                    progress(runner.log_tails())
                return report
            except BaseException:
                progress(runner.log_tails())
                raise


def _ready_columns(obj: Obj) -> dict[str, str]:
    """What `kubectl get dd` shows (the CRD's printer columns)."""
    status = obj.get("status") or {}
    return {
        "ready": condition(obj, "Ready").get("status", ""),
        "prefill": status.get("prefill", {}).get("ready", ""),
        "decode": status.get("decode", {}).get("ready", ""),
        "tp": status.get("tp", ""),
    }


def render_text(report: dict[str, Any]) -> str:
    lines = ["", "NAME                     READY   PREFILL   DECODE   TP"]
    for d in report["deployments"]:
        r = d["ready"]
        lines.append(f"{d['name']:<24} {r['ready']:<7} {r['prefill']:<9} {r['decode']:<8} {r['tp']}")
    for d in report["deployments"]:
        lines.append("")
        lines.append(f"{d['name']}: conditions {json.dumps(d['conditions'])}")
        if d.get("plan"):
            lines.append(f"  plan: {json.dumps(d['plan'])}")
        for e in d["endpoints"]:
            lines.append(
                f"  endpoint {e['pod']} {e['ip']}:{e['port']} ranks={e['ranks']} fingerprint={e['fingerprint']} "
                f"pairing={e.get('pairing', '')}"
            )
        if "transfers" in d:
            t = d["transfers"]
            speed = f"{t['gbps']} GB/s" if "gbps" in t else f"{t['meanRequestSeconds']} s per P/D request"
            what = "every byte checked" if t["check"] == "bytes" else "decode's tokens equal a single engine's"
            lines.append(
                f"  transfers: {t['verified']}/{t['requests']} verified, {what} "
                f"({t['verifiedAfterPrefillRestart']} after the prefill restart), {speed}"
            )
            for f in t["failures"]:
                lines.append(f"    FAILED {f['request']}: {f['code']}: {f['message']}")
            if t.get("duringOutage"):
                o = t["duringOutage"]
                said = "answered (another prefill pod)" if o["status"] == 200 else f"HTTP {o['status']} {o['code']}"
                lines.append(f"  a request right after the prefill kill: {said} in {o['seconds']} s")
            if t.get("router"):
                r = t["router"]
                lines.append(
                    f"  router: requests {json.dumps(r['requests'])}, prefill retries {r['prefillRetries']}, "
                    f"own time {r['meanOverheadMilliseconds']} ms per request"
                )
        if "pods" in d:
            lines.append(f"  pods created: {d['pods']}")
    lines.append("")
    lines.append("events:")
    for e in report["events"]:
        lines.append(f"  {e['type']:<8} {e['reason']:<17} {e['object']}: {e['message'][:160]}")
    lines.append("")
    lines.append("demo " + ("succeeded" if report["ok"] else "FAILED"))
    return "\n".join(lines)
