"""``kvbridge demo --serve``: the local cluster stays up for the user's own clients and tools.

The emulated API, the operator, the local kubelet stand-in (pods as processes, ended as a kubelet ends them) and
a router per compatible deployment keep running; stdout names the kubeconfig of the emulated API and each
router's URL, so ``kubectl``, ``curl``, the OpenAI SDK or ``vllm bench serve`` can be pointed at them. SIGINT or
SIGTERM stops everything (pods first, then the operator) and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path

from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.handlers import run_operator
from kvbridge_operator.kube import DEPLOYMENTS
from kvbridge_sim.apiserver import emulated_api
from kvbridge_sim.demo import NAMESPACE, LocalRouter, condition, documents, is_vllm, progress, start_router
from kvbridge_sim.demo import wait_for_verdicts as settle
from kvbridge_sim.kubectl import kubeconfig
from kvbridge_sim.runner import LocalRunner


def say(line: str) -> None:
    """A line for the user on stdout (progress goes to stderr)."""
    print(line, flush=True)


async def serve(files: list[str] | None, num_layers: int, engine: str, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set (the CLI sets it on SIGINT/SIGTERM)."""
    docs = documents(files, num_layers, engine)
    with tempfile.TemporaryDirectory(prefix="kvbridge-serve-") as folder:
        workdir = Path(folder)
        models: dict[str, str] = {}
        if any(is_vllm(d) for d in docs):
            from kvbridge_sim import tiny_model

            progress("making the tiny model (random weights, a tokenizer trained here) ...")
            models[tiny_model.NAME] = str(tiny_model.make(workdir / "tiny-llama"))
        async with emulated_api() as (_api, url, client):
            config = OperatorConfig(api_server=url, cpu_mode=True, agent_num_blocks=96, liveness_port=0)
            operator_stop, ready = asyncio.Event(), asyncio.Event()
            operator = asyncio.create_task(run_operator(config, operator_stop, ready_flag=ready))
            await asyncio.wait_for(ready.wait(), timeout=60)
            await asyncio.sleep(0.2)  # Kopf installs its own SIGINT/SIGTERM handlers: ours must win
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            runner, runner_stop = LocalRunner(client, workdir, models=models), asyncio.Event()
            running = asyncio.create_task(runner.run(runner_stop))
            routers: list[LocalRouter] = []
            try:
                names = []
                for doc in docs:
                    await client.create(DEPLOYMENTS, NAMESPACE, doc)
                    names.append(doc["metadata"]["name"])
                    progress(f"applied DisaggregatedDeployment {doc['metadata']['name']}")
                objects = await settle(client, names, 900 if models else 150, stop)
                config_path = workdir / "kubeconfig"
                config_path.write_text(kubeconfig(url))
                say(f"kubeconfig {config_path}  (export KUBECONFIG={config_path}; kubectl get dd)")
                for name in names:
                    if condition(objects[name], "Ready").get("status") == "True":
                        routers.append(await start_router(client, name))
                        say(f"router {name} {routers[-1].url}  (POST /v1/completions, /v1/chat/completions)")
                    else:
                        say(f"not served {name}: {condition(objects[name], 'Compatible').get('message', '')[:200]}")
                say("serving: Ctrl-C stops everything")
                await stop.wait()
            finally:  # the pods end first (engines drain on SIGTERM), then the operator
                for router in routers:
                    await router.close()
                runner_stop.set()
                await running
                await runner.close()
                operator_stop.set()
                await asyncio.wait_for(operator, timeout=30)
