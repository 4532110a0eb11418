"""Every variable of the environment contract is documented in docs/environment.md."""

from __future__ import annotations

from pathlib import Path

from kvbridge_agent.core.contract import EngineEnvironment, render_environment

ROOT = Path(__file__).parents[2]


def test_every_rendered_variable_is_documented() -> None:
    env = EngineEnvironment.model_validate(
        {
            "role": "prefill",
            "engineId": "e",
            "sideChannelListenPort": 0,
            "transferTokenFile": "/t",
            "model": {"name": "m", "numLayers": 1, "numKVHeads": 1, "headDim": 1},
            "prefill": {},
            "decode": {},
        }
    )
    text = (ROOT / "docs" / "environment.md").read_text()
    missing = [name for name in render_environment(env) if f"`{name}`" not in text]
    assert missing == []
