"""The demo's requests: through ``kvbridge router`` (run in this process, as ``spec.router``'s Deployment runs it) to
a deployment's pods, each answer checked (every byte with the synthetic engine, decode's tokens against a single
engine with vLLM), and halfway a prefill pod's engine killed to show a restart: the request sent at once, the pod
back, the rest going to its new engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvbridge_operator.kube import DEPLOYMENTS, KubeClient
from kvbridge_router.proxy import Router
from kvbridge_sim.demo_wait import NAMESPACE, DemoError, check, condition, progress
from kvbridge_sim.support import free_port, until

#: greedy tokens decode generates per request (compared with a single engine)
VLLM_MAX_TOKENS = 12


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
                label = f"{name} request {index + 1}/{requests}"
                if await _vllm_request(local, session, model, tokens, (f"{name}-{index}", label, index), result):
                    result.after_restart += int(restart and index >= requests // 2)
    finally:
        await local.close()
    result.router = local.router.metrics.summary()
    return result


async def _vllm_request(
    local: LocalRouter,
    session: aiohttp.ClientSession,
    model: str,
    tokens: int,
    request: tuple[str, str, int],
    result: Transfers,
) -> bool:
    """One request of ``tokens`` prompt tokens through the router (``request``: its id, its progress label, its
    index), its tokens compared with a single engine's on the decode pod; counted in ``result``. Whether they
    were equal."""
    from kvbridge_sim import pd_requests

    request_id, label, index = request
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
        result.failures.append(_failure(request_id, status, answer))
        progress(f"  {label}: {result.failures[-1]['code']}")
        return False
    got = list(answer["choices"][0]["token_ids"])
    try:
        want = await pd_requests.baseline(
            session, decode_url, model, prompt, VLLM_MAX_TOKENS, salt=f"demo-baseline-{index}"
        )
    except (pd_requests.PDRequestError, aiohttp.ClientError, TimeoutError) as exc:
        result.failures.append({"request": request_id, "code": "BASELINE_FAILED", "message": str(exc)})
        return False
    equal = got == want.tokens
    if equal:
        result.verified += 1
        result.seconds += seconds
        outcome = f"{tokens} prompt tokens, decode's {len(got)} tokens equal a single engine's"
    else:
        message = f"P/D {got} != single engine {want.tokens}"
        result.failures.append({"request": request_id, "code": "TOKENS_DIFFER", "message": message})
        outcome = "TOKENS_DIFFER"
    progress(f"  {label} via the router: {outcome}")
    return equal


def tiny_model_prompt(length: int, salt: int) -> list[int]:
    from kvbridge_sim.tiny_model import prompt

    return prompt(length, salt=1000 + salt)
