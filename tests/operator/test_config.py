"""Operator settings: a flag and a variable for every one, flags win, list values that may hold commas."""

from __future__ import annotations

import argparse

import pytest

from kvbridge_agent.core import SpecError
from kvbridge_operator.cli import main as cli
from kvbridge_operator.config import OperatorConfig, flag_of, from_flags, settings


def run_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    operator = commands.choices["operator"]
    actions = next(a for a in operator._actions if isinstance(a, argparse._SubParsersAction))
    run: argparse.ArgumentParser = actions.choices["run"]
    return run


def test_every_setting_has_a_flag() -> None:
    flags = {option for action in run_parser()._actions for option in action.option_strings}
    for item in settings():
        assert flag_of(item) in flags, item.name


def config_from(argv: list[str], environ: dict[str, str]) -> OperatorConfig:
    return from_flags(run_parser().parse_args(argv), environ)


def test_flags_reach_every_setting_and_win_over_variables() -> None:
    environ = {"KVBRIDGE_OPERATOR_VLLM_IMAGE": "env/vllm:1", "KVBRIDGE_OPERATOR_METRICS_PORT": "9000"}
    config = config_from(
        [
            "--vllm-image",
            "flag/vllm:2",
            "--vllm-cpu-image",
            "flag/cpu:2",
            "--routing-sidecar-image",
            "sidecar:1",
            "--routing-sidecar-arg=--connector=nixlv2",
            "--routing-sidecar-arg=--allow=a,b",
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--synthetic-num-blocks",
            "64",
            "--cpu-mode",
        ],
        environ,
    )
    assert config.vllm_image == "flag/vllm:2"
    assert config.vllm_cpu_image == "flag/cpu:2"
    assert config.routing_sidecar_image == "sidecar:1"
    assert config.routing_sidecar_args == ("--connector=nixlv2", "--allow=a,b")  # a comma inside one argument
    assert config.namespaces == ("a", "b")
    assert config.synthetic_num_blocks == 64
    assert config.cpu_mode is True
    assert config.metrics_port == 9000  # no flag given: the variable
    assert config_from([], {}) == OperatorConfig()


def test_a_json_array_keeps_commas_inside_sidecar_arguments() -> None:
    config = OperatorConfig.from_env({"KVBRIDGE_OPERATOR_ROUTING_SIDECAR_ARGS": '["--a=1,2", "--b"]'})
    assert config.routing_sidecar_args == ("--a=1,2", "--b")
    assert OperatorConfig.from_env({"KVBRIDGE_OPERATOR_NAMESPACES": "x, y"}).namespaces == ("x", "y")


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("ROUTING_SIDECAR_ARGS", '["--a"'),
        ("ROUTING_SIDECAR_ARGS", "[1, 2]"),
        ("METRICS_PORT", "http"),
        ("CPU_MODE", "maybe"),
    ],
)
def test_bad_variables_are_named(name: str, raw: str) -> None:
    with pytest.raises(SpecError) as caught:
        OperatorConfig.from_env({f"KVBRIDGE_OPERATOR_{name}": raw})
    assert caught.value.field == f"KVBRIDGE_OPERATOR_{name}"


def test_renamed_settings_still_read_their_former_names_and_the_new_name_wins() -> None:
    """Issue 57: agent_image, agent_num_blocks and agent_http_port said "agent" of the synthetic engine and of every
    engine's port; they are synthetic_image, synthetic_num_blocks and engine_http_port, the former variables and flags
    still read (deprecated)."""
    former = {
        "KVBRIDGE_OPERATOR_AGENT_IMAGE": "old/agent:1",
        "KVBRIDGE_OPERATOR_AGENT_NUM_BLOCKS": "32",
        "KVBRIDGE_OPERATOR_AGENT_HTTP_PORT": "9000",
    }
    config = OperatorConfig.from_env(former)
    assert (config.synthetic_image, config.synthetic_num_blocks, config.engine_http_port) == ("old/agent:1", 32, 9000)
    both = {
        **former,
        "KVBRIDGE_OPERATOR_SYNTHETIC_IMAGE": "new/synthetic:2",
        "KVBRIDGE_OPERATOR_ENGINE_HTTP_PORT": "9100",
    }
    config = OperatorConfig.from_env(both)
    assert (config.synthetic_image, config.engine_http_port) == ("new/synthetic:2", 9100)
    flags = config_from(["--agent-image", "flag/agent:3", "--agent-http-port", "9200", "--agent-num-blocks", "8"], {})
    assert (flags.synthetic_image, flags.engine_http_port, flags.synthetic_num_blocks) == ("flag/agent:3", 9200, 8)
    with pytest.raises(SpecError) as caught:
        OperatorConfig.from_env({"KVBRIDGE_OPERATOR_AGENT_HTTP_PORT": "http"})
    assert caught.value.field == "KVBRIDGE_OPERATOR_AGENT_HTTP_PORT"  # the variable that was set
    helps = {action.dest: action.help or "" for action in run_parser()._actions}
    assert "--agent-image is its former name (deprecated)" in helps["synthetic_image"]
