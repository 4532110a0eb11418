"""The README a new user opens (issue 59): the two commands first, then a short path for a user, and an index that
links every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_two_commands_come_first() -> None:
    first_block = README.split("```")[1]
    commands = [line.split()[1] for line in first_block.splitlines() if line.startswith("make ")]
    assert commands == ["demo", "test"]


def test_a_user_path_comes_before_the_details() -> None:
    headings = re.findall(r"(?m)^## (.+)$", README)
    assert headings[0] == "Your first hour"
    assert headings.index("Your first hour") < headings.index("What works today")
    assert headings.index("Documentation") < headings.index("What works today")
    path = README.split("## Your first hour", 1)[1].split("\n## ", 1)[0]
    assert "examples/vllm/" in path
    assert "kvbridge plan" in path


def test_the_index_links_every_page_of_docs() -> None:
    index = README.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)\)", index))
    assert linked == {page.name for page in (ROOT / "docs").glob("*.md")}
