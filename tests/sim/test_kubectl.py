"""The real kubectl against the emulated API, with the operator running: discovery, OpenAPI v3 (apply, explain,
strict field validation), server-side Tables with the CRDs' printer columns, ``scale``, ``describe`` and events.

Runs where a kubectl binary is installed (CI machines have one); elsewhere it skips, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvbridge_operator.kube import PODS
from kvbridge_sim.cluster import Cluster, StatefulSetController, cluster
from kvbridge_sim.kubectl import KUBECTL, kubeconfig, run
from kvbridge_sim.pod_logs import PodLog
from kvbridge_sim.support import until

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="no kubectl binary on the PATH (CI machines have one)")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml"


@contextlib.asynccontextmanager
async def running(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Path]]:
    """The emulated cluster with the operator and the StatefulSet controller stand-in, and a kubeconfig for it."""
    async with cluster() as c:
        config = tmp_path / "kubeconfig"
        config.write_text(kubeconfig(c.url))
        stop = asyncio.Event()
        controller = asyncio.create_task(StatefulSetController(c).run(stop))
        try:
            yield c, config
        finally:
            stop.set()
            await controller


async def kubectl(config: Path, arguments: str, *, ok: bool = True) -> str:
    done = await run(config, f"{KUBECTL} {arguments}")
    if ok:
        assert done.returncode == 0, (arguments, done.stdout, done.stderr)
        assert "Warning" not in done.stderr, done.stderr  # e.g. an ambiguous short name
    return done.stdout + done.stderr


async def eventually(config: Path, arguments: str, wanted: str, timeout: float = 20.0) -> str:
    """kubectl's output once it shows ``wanted``, or its last after ``timeout`` seconds (the caller's assertion
    shows it)."""
    out = ""

    async def shows() -> bool:
        nonlocal out
        out = await kubectl(config, arguments)
        return wanted in out

    with contextlib.suppress(TimeoutError):
        await until(shows, timeout, f"`kubectl {arguments}` to show {wanted!r}", interval=0.3)
    return out


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.strip().splitlines()]


async def test_discovery_names_the_resources_and_their_short_names(tmp_path: Path) -> None:
    async with running(tmp_path) as (_c, config):
        out = await kubectl(config, "api-resources --api-group=kvbridge.io")
        assert rows(out)[1:] == [
            ["disaggregateddeployments", "dd,disagg", "kvbridge.io/v1alpha1", "true", "DisaggregatedDeployment"],
            ["disaggregatedroles", "ddrole", "kvbridge.io/v1alpha1", "true", "DisaggregatedRole"],
        ]


async def test_apply_then_get_shows_the_documented_columns_and_scale_changes_the_effective_count(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as (_c, config):
        assert "disaggregateddeployment.kvbridge.io/llama3-8b created" in await kubectl(config, f"apply -f {EXAMPLE}")
        out = await eventually(config, "get dd", "True")
        header, row = rows(out)
        header_row = ["NAME", "READY", "AVAILABLE", "PREFILL", "DECODE", "TP", "ROUTER", "PLANNER", "PLANNED", "AGE"]
        assert header == header_row
        assert row[:6] == ["llama3-8b", "True", "True", "2/2", "1/1", "2→1"]  # no router, no planner: cells empty
        assert len(row) == 7
        assert "unchanged" in await kubectl(config, f"apply -f {EXAMPLE}")

        assert "scaled" in await kubectl(config, "scale ddrole/llama3-8b-decode --replicas=3")
        out = await eventually(config, "get ddrole", "decode    3         3")
        assert rows(out) == [
            ["NAME", "DEPLOYMENT", "ROLE", "DESIRED", "EFFECTIVE", "AGE"],
            ["llama3-8b-decode", "llama3-8b", "decode", "3", "3", rows(out)[1][-1]],
            ["llama3-8b-prefill", "llama3-8b", "prefill", "2", "2", rows(out)[2][-1]],
        ]
        out = await eventually(config, "get dd", "3/3")
        assert rows(out)[1][:5] == ["llama3-8b", "True", "True", "2/2", "3/3"]
        pods = rows(await kubectl(config, "get pods -l kvbridge.io/role=decode"))
        assert [p[0] for p in pods[1:]] == [f"llama3-8b-decode-{i}" for i in range(3)]
        assert pods[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
        jsonpath = await kubectl(config, "get dd llama3-8b -o jsonpath={.status.rollout.phase}")
        assert jsonpath == "Complete"


async def test_scale_of_a_kind_without_a_scale_subresource_is_not_found_and_changes_nothing(tmp_path: Path) -> None:
    """``kubectl scale dd`` (a DisaggregatedDeployment has no /scale; its roles do): a real API server answers
    NotFound and writes nothing. The emulator used to merge the Scale into the object (``spec.replicas``, which the
    schema refuses) and then fail with an AttributeError."""
    async with running(tmp_path) as (_c, config):
        await kubectl(config, f"apply -f {EXAMPLE}")
        before = await kubectl(config, "get dd llama3-8b -o jsonpath={.spec}")
        out = await kubectl(config, "scale dd llama3-8b --replicas=2", ok=False)
        assert "the server could not find the requested resource" in out, out
        assert "AttributeError" not in out
        assert await kubectl(config, "get dd llama3-8b -o jsonpath={.spec}") == before
        assert "replicas" not in await kubectl(config, "get dd llama3-8b -o jsonpath={.spec.replicas}")


async def test_logs_are_the_containers_log_with_tail_previous_and_follow(tmp_path: Path) -> None:
    """``kubectl logs`` reads the container's log where the local kubelet keeps it (pods/{name}/log), not the Pod
    object: ``--tail``, ``--previous`` (the container before the last restart) and ``-f`` (until it stops)."""
    async with running(tmp_path) as (c, config):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p-0"}}
        await c.client.create(PODS, "default", {**pod, "spec": {"containers": [{"name": "engine", "image": "x"}]}})
        current, previous = tmp_path / "p-0.log", tmp_path / "p-0.previous.log"
        current.write_text("line 1\nline 2\nline 3\n")
        alive = [True]

        def source(namespace: str, name: str) -> PodLog | None:
            kept = previous if previous.exists() else None
            return PodLog(current, kept, lambda: alive[0]) if (namespace, name) == ("default", "p-0") else None

        c.api.pod_logs = source
        assert await kubectl(config, "logs p-0") == "line 1\nline 2\nline 3\n"
        assert await kubectl(config, "logs p-0 --tail=1") == "line 3\n"
        out = await kubectl(config, "logs p-0 --previous", ok=False)
        assert 'previous terminated container "engine" in pod "p-0" not found' in out
        previous.write_text("before the restart\n")
        assert await kubectl(config, "logs p-0 --previous") == "before the restart\n"
        assert "not found" in await kubectl(config, "logs p-9", ok=False)
        followed = asyncio.create_task(run(config, f"{KUBECTL} logs -f p-0", timeout=30))
        await asyncio.sleep(1.5)
        with current.open("a") as log:
            log.write("line 4\n")
        await asyncio.sleep(1.0)
        alive[0] = False  # the container stops: the followed log ends
        done = await followed
        assert done.stdout == "line 1\nline 2\nline 3\nline 4\n", (done.stdout, done.stderr)


async def test_describe_and_get_events_show_the_operators_events(tmp_path: Path) -> None:
    async with running(tmp_path) as (_c, config):
        await kubectl(config, f"apply -f {EXAMPLE}")
        await eventually(config, "get dd", "True")
        described = await eventually(config, "describe dd llama3-8b", "EndpointsChanged")
        assert "Kind:         DisaggregatedDeployment" in described
        assert "Reason:                PlanBuilt" in described
        events_section = described.split("\nEvents:\n", 1)[1]
        assert "Normal  Reconciled" in events_section
        assert "kvbridge-operator" in events_section
        events = await kubectl(config, "get events --field-selector involvedObject.name=llama3-8b")
        header = events.splitlines()[0].split()
        assert header == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
        assert "disaggregateddeployment/llama3-8b" in events
        assert "Reconciled" in events


async def test_apply_refuses_an_unknown_field_as_a_real_server_does(tmp_path: Path) -> None:
    async with running(tmp_path) as (c, config):
        bad = EXAMPLE.read_text().replace("numLayers:", "numLayerz:")
        done = await run(config, f"{KUBECTL} apply -f - <<'EOF'\n{bad}\nEOF")
        assert done.returncode == 1
        assert 'strict decoding error: unknown field "spec.model.numLayerz"' in done.stderr
        assert c.api.find("disaggregateddeployments", "default", "llama3-8b") is None
        done = await run(config, f"{KUBECTL} apply --validate=false -f - <<'EOF'\n{bad}\nEOF")  # Ignore: stored as sent
        assert done.returncode == 0, done.stderr


async def test_explain_reads_the_crd_schema_over_openapi_v3(tmp_path: Path) -> None:
    async with running(tmp_path) as (_c, config):
        out = await kubectl(config, "explain dd.spec.engine.kind")
        assert "KIND:       DisaggregatedDeployment" in out
        assert "ENUM:" in out
        assert "VLLM (vLLM serving the model, the default)" in out


async def test_server_side_apply_of_the_crds_as_the_install_guide_does(tmp_path: Path) -> None:
    async with running(tmp_path) as (_c, config):
        out = await kubectl(config, f"apply --server-side -f {ROOT / 'crds'}")
        assert (
            "customresourcedefinition.apiextensions.k8s.io/disaggregateddeployments.kvbridge.io serverside-applied"
            in (out)
        )
        assert "disaggregateddeployments.kvbridge.io" in await kubectl(config, "get crd")


async def test_patch_replace_and_delete_answer_as_a_real_server(tmp_path: Path) -> None:
    """Issue 59: ``kubectl patch`` of a custom resource without ``--type=merge`` fails as on a cluster (a strategic
    merge patch is for built-in kinds), ``kubectl replace`` replaces, ``--dry-run=server`` changes nothing, and
    ``kubectl delete dd`` takes the deployment's children and pods with it (the garbage collector)."""
    async with running(tmp_path) as (c, config):
        await kubectl(config, f"apply -f {EXAMPLE}")
        await eventually(config, "get pods", "llama3-8b-decode-0")
        out = await kubectl(config, """patch dd llama3-8b -p '{"metadata":{"labels":{"team":"a"}}}'""", ok=False)
        assert "application/strategic-merge-patch+json is not supported" in out, out
        merged = await kubectl(config, """patch dd llama3-8b --type=merge -p '{"metadata":{"labels":{"team":"a"}}}'""")
        assert "patched" in merged
        document = await kubectl(config, "get dd llama3-8b -o json")
        replacement = document.replace('"team": "a"', '"team": "b"')
        done = await run(config, f"{KUBECTL} replace -f - <<'EOF'\n{replacement}\nEOF")
        assert done.returncode == 0, done.stderr
        assert await kubectl(config, "get dd llama3-8b -o jsonpath={.metadata.labels.team}") == "b"
        assert "(server dry run)" in await kubectl(config, "delete dd llama3-8b --dry-run=server")
        assert await kubectl(config, "get dd llama3-8b -o name") == "disaggregateddeployment.kvbridge.io/llama3-8b\n"
        assert "deleted" in await kubectl(config, "delete dd llama3-8b --wait=false")
        await until(lambda: not c.api.objects_of("statefulsets"), 20, "the StatefulSets garbage-collected")
        await until(lambda: not c.api.objects_of("pods"), 20, "the pods garbage-collected")
        assert not c.api.objects_of("services")


async def test_logs_name_a_container_the_pod_has_and_limit_bytes(tmp_path: Path) -> None:
    async with running(tmp_path) as (c, config):
        containers = [{"name": "engine", "image": "x"}, {"name": "sidecar", "image": "y"}]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p-0"}, "spec": {"containers": containers}}
        await c.client.create(PODS, "default", pod)
        log = tmp_path / "p-0.log"
        log.write_text("line 1\nline 2\n")
        c.api.pod_logs = lambda namespace, name: PodLog(log, None, lambda: False)
        assert await kubectl(config, "logs p-0 -c engine --limit-bytes=4") == "line"
        out = await kubectl(config, "logs p-0 -c nope", ok=False)
        assert "container nope is not valid for pod p-0" in out, out
        out = await kubectl(config, "logs p-0 -c sidecar", ok=False)
        assert 'container "sidecar" in pod "p-0" is waiting to start' in out, out
