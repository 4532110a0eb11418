"""``kvbridge demo --serve``: the local cluster stays up for the user's own clients and tools.

The emulated API, the operator, the local kubelet stand-in (pods as processes, ended as a kubelet ends them) and
a router per compatible deployment keep running; stdout names the kubeconfig of the emulated API and each
router's URL, so ``kubectl``, ``curl``, the OpenAI SDK or ``vllm bench serve`` can be pointed at them. SIGINT or
SIGTERM stops everything (routers, then pods, then the operator) and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from kvbridge_sim.demo import apply_all, documents, local_cluster, models_for
from kvbridge_sim.demo_traffic import LocalRouter, start_router
from kvbridge_sim.demo_wait import condition, wait_for_verdicts
from kvbridge_sim.kubectl import kubeconfig


def say(line: str) -> None:
    """A line for the user on stdout (progress goes to stderr)."""
    print(line, flush=True)


async def serve(files: list[str] | None, num_layers: int, engine: str, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set (on SIGINT/SIGTERM)."""
    docs = documents(files, num_layers, engine)
    with tempfile.TemporaryDirectory(prefix="kvbridge-serve-") as folder:
        workdir = Path(folder)
        models = models_for(docs, workdir)
        async with local_cluster(workdir, models, stop) as cluster:
            routers: list[LocalRouter] = []
            try:
                names = await apply_all(cluster.client, docs)
                objects = await wait_for_verdicts(
                    cluster.client, names, 900 if models else 150, stop, logs=cluster.runner.pod_log
                )
                config_path = workdir / "kubeconfig"
                config_path.write_text(kubeconfig(cluster.url))
                say(f"kubeconfig {config_path}  (export KUBECONFIG={config_path}; kubectl get dd)")
                for name in names:
                    if condition(objects[name], "Ready").get("status") == "True":
                        routers.append(await start_router(cluster.client, name))
                        model = objects[name]["spec"]["model"]["name"]
                        say(
                            f"router {name} {routers[-1].url} model {model}  (POST /v1/completions, "
                            "/v1/chat/completions)"
                        )
                    else:
                        say(f"not served {name}: {condition(objects[name], 'Compatible').get('message', '')[:200]}")
                say("serving: Ctrl-C stops everything")
                await stop.wait()
            finally:
                for router in routers:
                    await router.close()
