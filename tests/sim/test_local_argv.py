"""A local vLLM pod serves its model under ``spec.model.name`` only, as on a cluster: the local folder the name is
mapped to is what ``vllm serve`` loads, never a name clients see (``/v1/models`` lists the served names)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_agent.core import Role
from kvbridge_sim import pods
from kvbridge_sim.vllm_engines import MODEL_NAME, deployment, rendered_template

FOLDER = "/models/tiny-llama"


def served_names(argv: list[str]) -> list[str]:
    """What vLLM answers to: the values of ``--served-model-name`` (it takes several, up to the next flag)."""
    names: list[str] = []
    for index, arg in enumerate(argv):
        if arg == pods.SERVED_MODEL_NAME:
            following = argv[index + 1 :]
            names += following[: next((i for i, a in enumerate(following) if a.startswith("--")), len(following))]
        elif arg.startswith(f"{pods.SERVED_MODEL_NAME}="):
            names.append(arg.split("=", 1)[1])
    return names


@pytest.mark.parametrize("connector", ["Nixl", "KVBridge"])
@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_a_rendered_vllm_pod_loads_the_folder_and_serves_the_name_only(
    tmp_path: Path, connector: str, role: Role
) -> None:
    document = deployment(f"argv-{connector.lower()}", 1, connector=connector)
    spec = pods.local_pod(
        rendered_template(document, role), "pod-0", "127.0.3.1", tmp_path, models={MODEL_NAME: FOLDER}
    )
    argv = spec.argv
    assert argv[argv.index("serve") + 1] == FOLDER
    assert served_names(argv) == [MODEL_NAME]
    assert argv.count(FOLDER) == 1
    assert argv[argv.index("--host") + 1] == "127.0.3.1"


def test_a_name_the_command_already_serves_stays_a_name() -> None:
    """``spec.model.source`` renders ``vllm serve SOURCE --served-model-name NAME``: a runner that maps NAME to a
    folder must not turn the served name into that folder."""
    argv = ["vllm", "serve", "org/model", pods.SERVED_MODEL_NAME, MODEL_NAME, "--port", "8000"]
    local = pods.local_argv(argv, {MODEL_NAME: FOLDER, "org/model": FOLDER}, "127.0.3.2")
    assert local[:3] == ["vllm", "serve", FOLDER]
    assert served_names(local) == [MODEL_NAME]
    written = ["vllm", "serve", MODEL_NAME, f"{pods.SERVED_MODEL_NAME}=alias"]
    assert served_names(pods.local_argv(written, {MODEL_NAME: FOLDER}, "127.0.3.2")) == ["alias"]


def test_other_commands_get_the_folder_and_no_vllm_flags() -> None:
    argv = ["kvbridge-agent", "serve", "--model", MODEL_NAME]
    assert pods.local_argv(argv, {MODEL_NAME: FOLDER}, "127.0.3.3") == ["kvbridge-agent", "serve", "--model", FOLDER]
