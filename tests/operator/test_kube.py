"""Where the operator's API access comes from: a URL, a kubeconfig (flag, KUBECONFIG, context), in-cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from kvbridge_agent.core import KVBridgeError
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.handlers import run_operator
from kvbridge_operator.kube import DEPLOYMENTS, KubeClient, connect
from kvbridge_sim.cluster import cluster
from kvbridge_sim.local_api import stop_operator_beside

from .test_operator import example


def kubeconfig(path: Path, server: str, current: str = "staging") -> Path:
    """Two contexts on one server, told apart by their users' tokens."""
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "clusters": [{"name": "emulated", "cluster": {"server": server}}],
        "users": [{"name": "ops", "user": {"token": "ops-token"}}, {"name": "dev", "user": {"token": "dev-token"}}],
        "contexts": [
            {"name": "production", "context": {"cluster": "emulated", "user": "ops"}},
            {"name": "staging", "context": {"cluster": "emulated", "user": "dev"}},
        ],
    }
    path.write_text(yaml.safe_dump(document))
    return path


async def test_a_kubeconfig_flag_and_context_choose_the_credentials(tmp_path: Path) -> None:
    file = kubeconfig(tmp_path / "config", "http://127.0.0.1:1")
    chosen = await connect(kubeconfig=str(file), context="production", environ={})
    assert chosen.token == "ops-token"
    assert chosen.configuration.host == "http://127.0.0.1:1"
    assert "context production" in chosen.source
    current = await connect(kubeconfig=str(file), environ={})
    assert current.token == "dev-token"


async def test_kubeconfig_from_the_environment_wins_over_in_cluster(tmp_path: Path) -> None:
    file = kubeconfig(tmp_path / "config", "http://127.0.0.1:2")
    found = await connect(environ={"KUBECONFIG": str(file), "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert found.source == f"kubeconfig {file}"


async def test_no_kubeconfig_and_no_cluster_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(KVBridgeError) as missing:
        await connect(environ={"HOME": str(tmp_path)})
    assert missing.value.code == "NO_API_SERVER"
    assert "--kubeconfig" in missing.value.message
    broken = tmp_path / "broken"
    broken.write_text("apiVersion: v1\nkind: Config\ncontexts: []\n")
    with pytest.raises(KVBridgeError) as bad:
        await connect(kubeconfig=str(broken), context="nowhere", environ={})
    assert bad.value.code == "BAD_KUBECONFIG"
    assert str(broken) in bad.value.message


async def test_the_operator_runs_from_a_kubeconfig_with_its_context_token_on_every_request(tmp_path: Path) -> None:
    """`kvbridge operator run --kubeconfig F --context C` outside a cluster: the operator's client and Kopf's
    watches both use the context's credentials."""
    async with cluster(start=False) as c:
        seen: list[str] = []

        def record(verb: str, plural: str, headers: Mapping[str, str]) -> tuple[int, float] | None:
            if headers.get("User-Agent", "").startswith("kvbridge-test"):
                return None
            seen.append(headers.get("Authorization", ""))
            return None

        c.api.faults = record
        file = kubeconfig(tmp_path / "config", c.url)
        config = OperatorConfig(kubeconfig=str(file), context="production", liveness_port=0)
        stop = asyncio.Event()
        task = asyncio.create_task(run_operator(config, stop))
        try:
            await c.apply(example("synthetic/llama3-8b-hetero-tp"))
            await c.wait(lambda: c.condition("llama3-8b", "Compatible").get("status") == "True", what="Compatible")
        finally:
            await stop_operator_beside(c.url, task, stop, timeout=30)
        assert seen
        assert set(seen) == {"Bearer ops-token"}
        async with KubeClient.for_url(c.url) as client:
            assert await client.get(DEPLOYMENTS, "default", "llama3-8b") is not None


def test_operator_run_without_any_api_says_what_to_give_and_exits_2(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "operator", "run", "--liveness-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "NO_API_SERVER" in done.stderr
    assert "--kubeconfig" in done.stderr
    assert "Traceback" not in done.stderr
