"""``kvbridge plan`` on malformed manifests: a seeded fuzz of mutations of the examples (wrong types, huge and
deeply nested values, broken YAML, cut files). Every run ends with exit 0, 1 or 2, never a traceback or a hang; a
document that is invalid is named on stderr and, with --json, is an object with its problems."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "examples" / "synthetic").glob("*.yaml")) + sorted((ROOT / "examples" / "vllm").glob("*.yaml"))
JUNK: list[Any] = [
    None,
    "",
    "x" * 300,
    -1,
    0,
    2**70,
    1e308,
    float("nan"),
    True,
    [],
    {},
    [[[]]],
    {"a": {"b": []}},
    "9" * 5000,
    "\u0000",
    "&anchor",
    "*alias",
    "0x1F",
    "1e400",
    "yes",
]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*path, index))
    return found


def _set(document: Any, path: tuple[Any, ...], value: Any) -> None:
    for step in path[:-1]:
        document = document[step]
    document[path[-1]] = value


def _mutant(rng: random.Random) -> str:
    text = rng.choice(SOURCES).read_text()
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    kind = rng.randrange(7)
    if kind <= 2:  # a value anywhere replaced by junk of another type
        for _ in range(rng.randint(1, 3)):
            document = rng.choice(documents)
            path = rng.choice(_paths(document)[1:])
            _set(document, path, rng.choice(JUNK))
        return yaml.safe_dump_all(documents)
    if kind == 3:  # bytes flipped in the text
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(32, 127)
        return data.decode(errors="replace")
    if kind == 4:  # the file cut anywhere
        return text[: rng.randrange(len(text))]
    if kind == 5:  # a number longer than Python reads
        return re.sub(r"(?<=: )\d+", lambda m: "9" * rng.randint(4301, 9000), text, count=rng.randint(1, 3))
    depth = rng.randint(10, 3000)  # nesting where a scalar was (deep ones as text: the generator's YAML dump recurses)
    if depth > 200:
        return text + "\nx: " + "[" * depth + "]" * depth * rng.randint(0, 1) + "\n"
    document = rng.choice(documents)
    _set(document, rng.choice(_paths(document)[1:]), json.loads("[" * depth + "]" * depth))
    return yaml.safe_dump_all(documents, width=10**9)


FUZZ = """
import io, json, random, sys, traceback, contextlib
sys.path.insert(0, {here!r})
from test_plan_fuzz import _mutant
from kvbridge_operator.cli.main import main
rng = random.Random(int(sys.argv[1]))
outcomes = []
for i in range(int(sys.argv[2])):
    text = _mutant(rng)
    sys.stdin = io.StringIO(text)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", "-f", "-", "--json"])
    except BaseException:
        print(json.dumps({{"case": i, "crash": traceback.format_exc(), "input": text[:2000]}}))
        raise SystemExit(3)
    if code not in (0, 1, 2) or "Traceback" in err.getvalue():
        print(json.dumps({{"case": i, "code": code, "stderr": err.getvalue()[-2000:], "input": text[:2000]}}))
        raise SystemExit(3)
    if code == 2 and out.getvalue():
        entries = json.loads(out.getvalue())
        assert all(e.get("invalid") or "compatible" in e for e in entries), entries
    outcomes.append(code)
print(json.dumps({{"outcomes": outcomes}}))
"""


@pytest.mark.slow  # about 20 s on 2 cores (`make test` runs it)
def test_a_fuzz_of_malformed_manifests_never_crashes_kvbridge_plan() -> None:
    script = FUZZ.format(here=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script, "2026", "400"], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])["outcomes"]
    assert len(outcomes) == 400
    assert outcomes.count(2) > 200  # most mutations are invalid; the others still get their verdicts
