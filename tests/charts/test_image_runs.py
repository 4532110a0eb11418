"""The images built here (kvbridge_sim.images: mmdebstrap, buildah, podman; no Docker engine) and run: the operator
image's commands and its operator against the emulated API; the CPU engine image serving the tiny model in P/D with
kvbridge's connector, tokens equal to a single engine.

Marked ``images`` (and ``slow``): skipped, saying why, where the tools are missing or the user is not root, except
under CI=true, where `make test` has installed them (`make image-tools`) and a skip would hide a failure. The CPU
engine image's test is marked ``engine_image`` too: its first build takes minutes and 4.7 GB, so `make test` leaves it
out and `make images-test` runs it (docs/install.md)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvbridge_agent.core import Role
from kvbridge_sim import images, pd_requests
from kvbridge_sim.cluster import cluster
from kvbridge_sim.support import wait_until
from kvbridge_sim.vllm_engines import MODEL_NAME, deployment, plan_json, plan_json_pod
from tests.operator.test_kube import kubeconfig

pytestmark = [pytest.mark.images, pytest.mark.slow]

#: the image's user (the Dockerfiles' USER)
USER = "65532"
#: what the operator image plans and reconciles: vLLM on GPUs, prefill TP 2 -> decode TP 1 (no example file: those
#: are the docs')
GPU_DEPLOYMENT = deployment("image-check", 2, device="GPU")
#: how long one engine container may take to answer /health (about a minute each here, two at once)
ENGINE_START_SECONDS = 600.0


def require_tools() -> None:
    """Skip without the tools or root (buildah's chroot isolation and podman's storage are root's here); under CI
    that is a failure."""
    missing = images.missing_tools()
    reasons = [f"{', '.join(missing)} missing (make image-tools: apt-get install)"] if missing else []
    if os.geteuid() != 0:
        reasons.append("not root (the images are built and run as root here)")
    if not reasons:
        return
    message = f"cannot build or run the images: {'; '.join(reasons)}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def podman(*argv: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def operator_image() -> str:
    require_tools()
    return images.build(images.IMAGES["operator"], torch_index=os.environ.get("TORCH_INDEX", "")).name


@pytest.fixture(scope="session")
def engine_image() -> str:
    require_tools()
    return images.build(images.IMAGES["vllm-engine-cpu"], torch_index=os.environ.get("TORCH_INDEX", "")).name


def test_the_operator_image_runs_its_commands_as_its_user(operator_image: str) -> None:
    started = time.monotonic()
    helped = podman(*images.run_argv(operator_image, ["--help"]))
    assert helped.returncode == 0, helped.stderr
    assert "plan" in helped.stdout
    assert "operator" in helped.stdout
    run_seconds = time.monotonic() - started
    manifest = yaml.safe_dump(GPU_DEPLOYMENT)
    planned = podman(*images.run_argv(operator_image, ["plan", "-f", "-"], stdin=True), stdin=manifest)
    assert planned.returncode == 0, planned.stderr
    assert "compatible" in planned.stdout.lower()
    assert "vLLM" in planned.stdout
    # no API server: a clean refusal, the exit code the chart's pod would show
    alone = podman(*images.run_argv(operator_image, ["operator", "run", "--liveness-port", "0"]))
    assert alone.returncode == 2, alone.stderr
    assert "NO_API_SERVER" in alone.stderr
    assert "Traceback" not in alone.stderr
    router = podman(*images.run_argv(operator_image, ["--help"], entrypoint=["kvbridge-router"]))
    assert router.returncode == 0, router.stderr
    who = podman(*images.run_argv(operator_image, ["-u"], entrypoint=["id"]))
    assert who.stdout.strip() == USER
    assert run_seconds < 30, f"one podman run took {run_seconds:.1f} s"


async def test_the_operator_image_reconciles_a_deployment_on_the_emulated_api(
    operator_image: str, tmp_path: Path
) -> None:
    """`kvbridge operator run` in the image, on the host's network, against the emulated API server (a kubeconfig
    mounted read-only): it sets the deployment's Compatible condition as the in-process operator does."""
    name = f"kvbridge-test-operator-{os.getpid()}"
    async with cluster(start=False) as c:
        config = kubeconfig(tmp_path / "config", c.url)
        argv = images.run_argv(
            operator_image,
            ["operator", "run", "--kubeconfig", "/kube/config", "--liveness-port", "0"],
            volumes={str(config): "/kube/config"},
            name=name,
        )
        started = await asyncio.to_thread(podman, *argv)
        assert started.returncode == 0, started.stderr
        try:
            await c.apply(GPU_DEPLOYMENT)
            await c.wait(
                lambda: c.condition("image-check", "Compatible").get("status") == "True", timeout=90, what="Compatible"
            )
            # and its children: a StatefulSet per role, created by the operator in the container
            await c.wait(lambda: len(c.api.objects_of("statefulsets")) == 2, timeout=30, what="two StatefulSets")
        except Exception:
            logs = await asyncio.to_thread(podman, "podman", "logs", name)
            print(f"--- the operator container's log ---\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
            raise
        finally:
            await asyncio.to_thread(podman, "podman", "rm", "--force", "--time=10", name)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


def _running(name: str) -> bool:
    state = podman("podman", "container", "inspect", "--format", "{{.State.Running}}", name)
    return state.stdout.strip() == "true"


@pytest.fixture
def engine_pair(engine_image: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A prefill and a decode container of the CPU engine image, each started from `kvbridge plan --json` alone
    (as tests/vllm starts local processes), on its own loopback address and core; their URLs."""
    pytest.importorskip("transformers", reason="the tiny model is made with transformers (installed with vLLM)")
    from kvbridge_agent.transfer.keys import generate_keys
    from kvbridge_sim import tiny_model

    model = tiny_model.make(tmp_path / "tiny-llama")
    for file in model.iterdir():  # the weights are written 0600: readable by the image's user, as a volume's are
        file.chmod(0o644)
    keys = tmp_path / "keys"
    generate_keys(keys)
    for path in (keys, *keys.iterdir()):  # the Secret's mount, readable by the image's user (a pod's fsGroup)
        os.chown(path, int(USER), int(USER))
    entry = plan_json(deployment("tiny-image", 1, connector="KVBridge"), tmp_path / "plans")
    suffix = os.getpid()
    started: dict[str, str] = {}
    try:
        for role, core in ((Role.PREFILL, 0), (Role.DECODE, 1)):
            name, ip = f"kvbridge-test-{role.value.lower()}-{suffix}", f"127.0.3.{2 + core}"
            spec = plan_json_pod(
                entry,
                role,
                name,
                ip,
                tmp_path / name,
                models={MODEL_NAME: "/models/tiny-llama"},
                env_overrides={"KVBRIDGE_KEYS_DIR": "/keys", "HF_HUB_OFFLINE": "1"},
            )
            argv = images.run_argv(
                engine_image,
                spec.argv[1:],
                entrypoint=spec.argv[:1],
                volumes={str(model): "/models/tiny-llama", str(keys): "/keys"},
                env=spec.env,
                name=name,
                cpus=(core,) if len(os.sched_getaffinity(0)) > 1 else (),
                remove=False,
            )
            done = podman(*argv)
            assert done.returncode == 0, done.stderr
            started[name] = f"http://{ip}:{spec.http_port}"
        urls = list(started.values())

        def ready() -> bool:
            ended = [name for name in started if not _running(name)]
            if ended:
                raise AssertionError(f"{', '.join(ended)} ended before answering /health")
            return all(_healthy(url) for url in urls)

        wait_until(ready, ENGINE_START_SECONDS, "both engines' /health", interval=1)
        yield urls[0], urls[1]
    except Exception:
        for name in started:
            logs = podman("podman", "logs", name)
            print(f"--- {name}'s log ---\n{(logs.stdout + logs.stderr)[-3000:]}")
        raise
    finally:
        if started:  # both at once: vLLM drains for up to its --shutdown-timeout, then is killed
            podman("podman", "rm", "--force", "--time=15", *started)


@pytest.mark.engine_image
@pytest.mark.vllm
async def test_the_cpu_engine_image_serves_pd_with_kvbridges_connector(engine_pair: tuple[str, str]) -> None:
    from kvbridge_sim.tiny_model import prompt
    from tests.vllm.assertions import assert_pd_equals_single_engine

    prefill, decode = engine_pair
    async with pd_requests.client_session(300) as session:
        for length in (7, 3 * 32 + 13):
            tokens = prompt(length, salt=700 + length)
            await assert_pd_equals_single_engine(
                session, prefill, decode, MODEL_NAME, tokens, 12, salt=f"image-{length}", what=f"{length} tokens"
            )
            params = await pd_requests.prefill(session, prefill, MODEL_NAME, tokens)
            assert params["kvbridge"]["numTokens"] == length  # kvbridge's connector answered, not vLLM's own
