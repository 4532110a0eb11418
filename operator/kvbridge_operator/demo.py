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
import copy
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .config import OperatorConfig
from .kube import DEPLOYMENTS, PODS, KubeClient, Resource
from .manifests import deployments_of, parse_documents, read_text, source_name
from .render import LABEL_DEPLOYMENT, LABEL_PAIRING, LABEL_ROLE

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEFAULT_FILES = {
    "vllm": ("vllm/tiny-cpu.yaml", "incompatible-replicated-heads.yaml"),
    "agent": ("llama3-8b-hetero-tp.yaml", "incompatible-replicated-heads.yaml"),
}
#: greedy tokens decode generates per request (compared with a single engine)
VLLM_MAX_TOKENS = 12
CRDS = Resource("apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
NAMESPACE = "default"

Obj = dict[str, Any]


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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests, "verified": self.verified, "check": self.check,
            "verifiedAfterPrefillRestart": self.after_restart, "failures": self.failures,
        }  # fmt: skip
        if self.check == "bytes":
            out["gbps"] = round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0
        else:
            out["meanRequestSeconds"] = round(self.seconds / self.verified, 3) if self.verified else 0.0
        return out


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_vllm(document: Obj) -> bool:
    return bool((document.get("spec", {}).get("engine") or {}).get("kind") == "VLLM")


def documents(files: list[str] | None, num_layers: int, engine: str = "vllm") -> list[Obj]:
    """The manifests to apply; agent-engine models scaled down to ``num_layers`` so the demo fits this machine
    (vLLM engines serve a real model, whose geometry the spec must state as it is)."""
    paths = files or [str(EXAMPLES / name) for name in DEFAULT_FILES[engine]]
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
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        check(interrupted)
        objects = {n: await client.get(DEPLOYMENTS, NAMESPACE, n) or {} for n in names}
        settled = all(condition(o, "Compatible").get("status") == "False" or condition(o, "Ready").get("status")
                      == "True" for o in objects.values())  # fmt: skip
        line = "; ".join(f"{n}: {_short(condition(o, 'Ready').get('message') or 'waiting for the operator')}"
                         for n, o in objects.items())  # fmt: skip
        if line != last:
            progress(f"  {line}")
            last = line
        if settled:
            return objects
        if time.monotonic() > deadline:
            raise DemoError(f"not settled after {timeout:g} s: {line}")
        await asyncio.sleep(0.5)


def _short(message: str, limit: int = 100) -> str:
    """One status message in a progress line (the full text is in the report and the events)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


async def transfer(session: aiohttp.ClientSession, prefill_url: str, decode_url: str, request_id: str,
                   tokens: int, hit: int, result: Transfers) -> bool:  # fmt: skip
    result.requests += 1
    async with session.post(f"{prefill_url}/v1/prefill", json={"requestId": request_id, "numTokens": tokens}) as r:
        body = await r.json()
    if r.status != 200:
        result.failures.append(
            {"request": request_id, "code": body["error"]["code"], "message": body["error"]["message"]}
        )
        return False
    params = body["kvTransferParams"]
    payload = {"requestId": f"decode-{request_id}", "kvTransferParams": params, "prefixHitBlocks": hit}
    async with session.post(f"{decode_url}/v1/decode", json=payload) as r:
        body = await r.json()
    if r.status != 200 or body.get("verified") is not True:
        error = body.get("error", {"code": "NOT_VERIFIED", "message": "decode did not verify"})
        result.failures.append({"request": request_id, "code": error["code"], "message": error["message"]})
        return False
    result.verified += 1
    result.bytes += int(body["bytes"])
    result.seconds += float(body["transferSeconds"])
    return True


def pair(endpoints: list[Obj], decode_pods: list[Obj], pairings: list[Obj] | None = None) -> list[tuple[Obj, str]]:
    """Every (prefill endpoint, decode pod name) whose pairing keys are equal (one checked plan) or listed together
    in ``status.rollout.pairings`` (the operator checked that mix during a rollout). Nothing else is paired: the
    old and new pods of an incompatible change are not one plan."""
    allowed = {(str(p.get("prefill")), str(p.get("decode"))) for p in pairings or []}
    found = []
    for pod in decode_pods:
        decode_key = pod["metadata"].get("labels", {}).get(LABEL_PAIRING)
        for endpoint in endpoints:
            key = endpoint.get("pairing")
            if key and decode_key and (key == decode_key or (key, decode_key) in allowed):
                found.append((endpoint, pod["metadata"]["name"]))
    return found


async def targets(client: KubeClient, runner: Any, name: str) -> tuple[Obj, list[tuple[Obj, str]]]:
    """What a router sees of a deployment: the resource, and its (prefill endpoint, decode URL) pairs."""
    dd = await client.get(DEPLOYMENTS, NAMESPACE, name) or {}
    endpoints = (dd.get("status") or {}).get("prefill", {}).get("endpoints") or []
    pods = await client.list(PODS, NAMESPACE, f"{LABEL_DEPLOYMENT}={name},{LABEL_ROLE}=decode")
    checked = ((dd.get("status") or {}).get("rollout") or {}).get("pairings") or []
    pairs = [(endpoint, runner.http_url(NAMESPACE, pod)) for endpoint, pod in pair(endpoints, pods, checked)]
    if not pairs:
        raise DemoError(f"{name}: no prefill endpoint and decode pod of one pairing key to route to")
    return dd, pairs


async def route(
    client: KubeClient, runner: Any, name: str, requests: int, restart: bool, interrupted: asyncio.Event | None = None
) -> Transfers:
    """Play the router: prefill computes, decode pulls through the published endpoints; one prefill restart."""
    result = Transfers()
    dd, pairs = await targets(client, runner, name)
    spec = dd["spec"]
    block = max(int(spec.get("prefill", {}).get("blockSize", 16)), int(spec.get("decode", {}).get("blockSize", 16)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for index in range(requests):
            check(interrupted)
            if restart and index == requests // 2:
                victim = pairs[0][0]["pod"]
                progress(f"  restarting prefill pod {victim} (its engine is killed; the runner starts it again)")
                runner.crash(NAMESPACE, victim)
                await wait_restarted(client, name, victim, interrupted=interrupted)
                dd, pairs = await targets(client, runner, name)
            endpoint, decode_url = pairs[index % len(pairs)]
            tokens = [3 * block + 5, 1, 7 * block, 2 * block + 1][index % 4]
            hit = 1 if index % 4 == 2 else 0
            ok = await transfer(session, runner.http_url(NAMESPACE, endpoint["pod"]), decode_url,
                                f"{name}-{index}", tokens, hit, result)  # fmt: skip
            if ok and restart and index >= requests // 2:
                result.after_restart += 1
            progress(f"  {name} request {index + 1}/{requests} via {endpoint['pod']}: "
                     f"{'verified' if ok else result.failures[-1]['code']}")  # fmt: skip
    return result


async def wait_restarted(
    client: KubeClient, name: str, pod: str, timeout: float = 120, interrupted: asyncio.Event | None = None
) -> None:
    deadline = time.monotonic() + timeout
    seen_down = False
    while time.monotonic() < deadline:
        check(interrupted)
        dd = await client.get(DEPLOYMENTS, NAMESPACE, name) or {}
        pods = [e["pod"] for e in (dd.get("status") or {}).get("prefill", {}).get("endpoints") or []]
        seen_down = seen_down or pod not in pods
        if seen_down and pod in pods and condition(dd, "Ready").get("status") == "True":
            return
        await asyncio.sleep(0.3)
    raise DemoError(f"{pod} did not come back within {timeout:g} s")


async def route_vllm(
    client: KubeClient, runner: Any, name: str, requests: int, model: str, interrupted: asyncio.Event | None = None
) -> Transfers:
    """Play the router for vLLM pods: prefill computes, decode pulls the KV cache over NIXL and generates; every
    answer is compared with a single-engine run of the same prompt. Halfway, a prefill pod's engine is killed;
    once the runner has restarted it, the remaining requests go on (decode meets a new engine id)."""
    from .local import pd_requests

    dd, pairs = await targets(client, runner, name)
    block = int(dd["spec"].get("decode", {}).get("blockSize", 32))
    victim = pairs[0][0]["pod"] if requests >= 2 else None
    result = Transfers(check="tokens", restarted=victim is not None)
    async with pd_requests.client_session(300) as session:
        for index in range(requests):
            check(interrupted)
            if victim and index == requests // 2:
                progress(f"  killing prefill pod {victim}'s engine (the runner restarts it, as a kubelet would; vLLM "
                         "takes about a minute to come back here) ...")  # fmt: skip
                runner.crash(NAMESPACE, victim)
                await wait_restarted(client, name, victim, timeout=600, interrupted=interrupted)
                dd, pairs = await targets(client, runner, name)
                progress(f"  {victim} is back with a new vLLM engine id: decode must handshake with it again")
            endpoint, decode_url = pairs[index % len(pairs)]
            pod = endpoint["pod"]
            after = bool(victim) and index >= requests // 2
            tokens = [3 * block + 5, 7, 2 * block, block + 1][index % 4]
            prompt = tiny_model_prompt(tokens, salt=index)
            prefill_url = runner.http_url(NAMESPACE, pod)
            result.requests += 1
            try:
                got = await pd_requests.disaggregated(session, prefill_url, decode_url, model, prompt,
                                                      VLLM_MAX_TOKENS)  # fmt: skip
                want = await pd_requests.baseline(session, decode_url, model, prompt, VLLM_MAX_TOKENS,
                                                  salt=f"demo-baseline-{index}")  # fmt: skip
            except (pd_requests.PDRequestError, aiohttp.ClientError, TimeoutError) as exc:
                result.failures.append({"request": f"{name}-{index}", "code": "REQUEST_FAILED", "message": str(exc)})
                progress(f"  {name} request {index + 1}/{requests} via {pod}: REQUEST_FAILED")
                continue
            if got.tokens == want.tokens:
                result.verified += 1
                result.seconds += got.seconds
                result.after_restart += int(after)
                outcome = f"{tokens} prompt tokens, decode's {len(got.tokens)} tokens equal a single engine's"
            else:
                result.failures.append({"request": f"{name}-{index}", "code": "TOKENS_DIFFER",
                                        "message": f"P/D {got.tokens} != single engine {want.tokens}"})  # fmt: skip
                outcome = "TOKENS_DIFFER"
            progress(f"  {name} request {index + 1}/{requests} via {pod}: {outcome}")
    return result


def tiny_model_prompt(length: int, salt: int) -> list[int]:
    from .local.tiny_model import prompt

    return prompt(length, salt=1000 + salt)


def events_of(api: Any, name: str) -> list[Obj]:
    return [{"object": f"DisaggregatedDeployment/{e['involvedObject']['name']}", "type": e["type"],
             "reason": e["reason"], "message": e["message"]}
            for e in api.objects_of("events") if e.get("involvedObject", {}).get("name") == name]  # fmt: skip


def check(interrupted: asyncio.Event | None) -> None:
    if interrupted is not None and interrupted.is_set():
        raise DemoError("interrupted")


async def run_demo(
    files: list[str] | None,
    requests: int,
    num_layers: int,
    interrupted: asyncio.Event | None = None,
    engine: str = "vllm",
) -> dict[str, Any]:
    import kmock

    from .crd import crds
    from .handlers import run_operator
    from .local.apiserver import RealisticKubernetes
    from .local.runner import LocalRunner

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
        models: dict[str, str] = {}
        if vllm_docs:
            from .local import tiny_model

            progress("making the tiny model (random weights, a tokenizer trained here) ...")
            models[tiny_model.NAME] = str(tiny_model.make(Path(workdir) / "tiny-llama"))
        async with RealisticKubernetes() as api, kmock.Server(api) as server:
            url = str(server.url).rstrip("/")
            client = KubeClient.for_url(url)
            for definition in crds():
                await client.create(CRDS, "", definition)
            config = OperatorConfig(api_server=url, cpu_mode=True, agent_num_blocks=96, liveness_port=0)
            stop, ready = asyncio.Event(), asyncio.Event()
            operator = asyncio.create_task(run_operator(config, stop, ready_flag=ready))
            await asyncio.wait_for(ready.wait(), timeout=60)
            await asyncio.sleep(0.2)  # Kopf installs its own SIGINT/SIGTERM handlers: ours must win
            if interrupted is not None:
                loop = asyncio.get_running_loop()
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(signum, interrupted.set)
            runner = LocalRunner(client, Path(workdir), models=models)
            running = asyncio.create_task(runner.run(stop))
            try:
                names = []
                for doc in docs:
                    await client.create(DEPLOYMENTS, NAMESPACE, doc)
                    names.append(doc["metadata"]["name"])
                    progress(f"applied DisaggregatedDeployment {doc['metadata']['name']}")
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
                            model = models.get(obj["spec"]["model"]["name"], obj["spec"]["model"]["name"])
                            transfers = await route_vllm(client, runner, name, requests, model, interrupted)
                        else:
                            transfers = await route(client, runner, name, requests, True, interrupted)
                        await asyncio.sleep(1.0)  # let the operator publish the last pod events
                        entry["transfers"] = transfers.to_dict()
                        final = await client.get(DEPLOYMENTS, NAMESPACE, name) or obj
                        entry["conditions"] = {c["type"]: c["status"] for c in final["status"]["conditions"]}
                        entry["endpoints"] = final["status"]["prefill"].get("endpoints") or []
                        entry["ready"] = _ready_columns(final)
                        report["ok"] &= (transfers.verified == transfers.requests
                                         and (transfers.after_restart > 0 or not transfers.restarted)
                                         and entry["conditions"].get("Ready") == "True")  # fmt: skip
                    else:
                        pods = await client.list(PODS, NAMESPACE, f"{LABEL_DEPLOYMENT}={name}")
                        entry["pods"] = len(pods)
                        report["ok"] &= not pods and condition(obj, "Compatible").get("reason") == "Incompatible"
                    report["deployments"].append(entry)
                    report["events"] += events_of(api, name)
                restarted = any(e["reason"] == "PrefillRestarted" for e in report["events"])
                report["ok"] &= restarted or not any(d.get("transfers", {}).get("verifiedAfterPrefillRestart")
                                                     for d in report["deployments"])  # fmt: skip
                return report
            finally:
                stop.set()
                await running
                await runner.close()
                await asyncio.wait_for(operator, timeout=30)
                await client.close()


def _ready_columns(obj: Obj) -> dict[str, str]:
    """What `kubectl get dd` shows (the CRD's printer columns)."""
    status = obj.get("status") or {}
    return {"ready": condition(obj, "Ready").get("status", ""), "prefill": status.get("prefill", {}).get("ready", ""),
            "decode": status.get("decode", {}).get("ready", ""), "tp": status.get("tp", "")}  # fmt: skip


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
            lines.append(f"  transfers: {t['verified']}/{t['requests']} verified, {what} "
                         f"({t['verifiedAfterPrefillRestart']} after the prefill restart), {speed}")  # fmt: skip
            for f in t["failures"]:
                lines.append(f"    FAILED {f['request']}: {f['code']}: {f['message']}")
        if "pods" in d:
            lines.append(f"  pods created: {d['pods']}")
    lines.append("")
    lines.append("events:")
    for e in report["events"]:
        lines.append(f"  {e['type']:<8} {e['reason']:<17} {e['object']}: {e['message'][:160]}")
    lines.append("")
    lines.append("demo " + ("succeeded" if report["ok"] else "FAILED"))
    return "\n".join(lines)
