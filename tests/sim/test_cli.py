"""``kvbridge demo`` comes from kvbridge_sim through an entry point: the operator never imports the simulation."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from kvbridge_operator.cli.main import COMMANDS_GROUP

BLOCKED = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "kvbridge_sim":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
from kvbridge_operator.cli.main import main
sys.argv = ["kvbridge", "demo", "--engine", "agent"]
sys.exit(main())
"""


def test_the_demo_command_is_the_simulations_entry_point() -> None:
    [entry] = entry_points(group=COMMANDS_GROUP, name="demo")
    assert entry.value == "kvbridge_sim.cli:demo"
    from kvbridge_sim.cli import demo

    assert entry.load() is demo


def test_without_the_simulation_the_demo_says_so_and_nothing_else_breaks() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "this installation has no kvbridge_sim" in done.stderr
    assert "make demo" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_demos_manifests_are_the_examples_the_docs_show() -> None:
    """The demo ships its manifests as package data (it runs wherever kvbridge_sim is installed); they are the
    examples byte for byte."""
    from pathlib import Path

    from kvbridge_sim.demo import DEFAULT_FILES, MANIFESTS

    sources = {
        "tiny-cpu.yaml": "vllm/tiny-cpu.yaml",
        "llama3-8b-hetero-tp.yaml": "synthetic/llama3-8b-hetero-tp.yaml",
        "incompatible-replicated-heads.yaml": "synthetic/incompatible-replicated-heads.yaml",
    }
    assert {name for names in DEFAULT_FILES.values() for name in names} == set(sources)
    examples = Path(__file__).parents[2] / "examples"
    for name, source in sources.items():
        assert (MANIFESTS / name).read_bytes() == (examples / source).read_bytes(), f"copy examples/{source}"
