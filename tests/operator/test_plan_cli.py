"""``kvbridge plan`` as in docs/cli.md: JSON shape, multi-document input, exit codes, errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge_operator.cli.main import main

EXAMPLES = Path(__file__).parents[2] / "examples" / "synthetic"
HETERO = EXAMPLES / "llama3-8b-hetero-tp.yaml"
INCOMPATIBLE = EXAMPLES / "incompatible-replicated-heads.yaml"
CONTRACT_KEYS = {
    "name",
    "decodeRank",
    "compatible",
    "problems",
    "tpRatio",
    "blockSizeRatio",
    "handshakeRanks",
    "reads",
    "notifyOnlyRanks",
    "notificationsPerPrefillRank",
    "localBlockBytes",
    "remoteBlockBytes",
    "wireBlockSize",
    "wireLayout",
    "conversions",
    "fingerprint",
}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_contract_json_for_the_heterogeneous_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "-f", str(HETERO), "--all-ranks", "--json")
    assert code == 0
    assert err == ""
    [entry] = json.loads(out)
    assert set(entry) >= CONTRACT_KEYS
    assert entry["name"] == "llama3-8b"
    assert entry["compatible"] is True
    assert entry["tpRatio"] == -2
    assert entry["handshakeRanks"] == [0, 1]
    assert entry["reads"] == [
        {"prefillRank": 0, "remoteOffsetBytes": 0, "localOffsetBytes": 0, "lengthBytes": 16384},
        {"prefillRank": 1, "remoteOffsetBytes": 0, "localOffsetBytes": 16384, "lengthBytes": 16384},
    ]
    assert (entry["localBlockBytes"], entry["remoteBlockBytes"]) == (32768, 16384)
    assert (entry["wireBlockSize"], entry["wireLayout"], entry["conversions"]) == (16, "HND", [])
    assert len(entry["fingerprint"]) == 8


def test_incompatible_example_exits_1_with_problems(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "-f", str(INCOMPATIBLE), "--json")
    assert code == 1
    [entry] = json.loads(out)
    assert entry["compatible"] is False
    assert entry["problems"][0]["code"] == "PREFILL_HEADS_REPLICATED"
    assert entry["problems"][0]["field"] == "spec.prefill.tensorParallelSize"
    assert entry["suggestedFix"] == {"spec.prefill.tensorParallelSize": 2}
    code, out, _ = run(capsys, "plan", "-f", str(INCOMPATIBLE))
    assert code == 1
    assert "INCOMPATIBLE" in out
    assert "PREFILL_HEADS_REPLICATED at spec.prefill.tensorParallelSize" in out
    assert "a fix for all of them at once, checked: spec.prefill.tensorParallelSize: 2" in out
    assert (
        "kubectl patch disaggregateddeployment replicated-heads --type merge "
        """-p '{"spec":{"prefill":{"tensorParallelSize":2}}}'""" in out
    )


def test_multi_document_input_and_all_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    combined = tmp_path / "all.yaml"
    documents = [p.read_text() for p in sorted(EXAMPLES.glob("*.yaml"))]
    combined.write_text("\n---\n".join(documents) + "\n---\n")
    code, out, _ = run(capsys, "plan", "-f", str(combined), "--all-ranks", "--json")
    assert code == 1  # one example is incompatible on purpose
    entries = json.loads(out)
    names = [e["name"] for e in entries]
    assert names == sorted(set(names), key=names.index)  # document order kept
    assert {e["name"]: e["compatible"] for e in entries}["replicated-heads"] is False


def test_decode_rank_selects_one_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "d.yaml"
    manifest.write_text(HETERO.read_text().replace("tensorParallelSize: 1", "tensorParallelSize: 4"))
    code, out, _ = run(capsys, "plan", "-f", str(manifest), "--decode-rank", "3", "--json")
    assert code == 0
    [entry] = json.loads(out)
    assert entry["decodeRank"] == 3
    assert entry["reads"] == [{"prefillRank": 1, "remoteOffsetBytes": 8192, "localOffsetBytes": 0, "lengthBytes": 8192}]
    assert entry["notificationsPerPrefillRank"] == 2


def test_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(HETERO.read_text()))
    code, out, _ = run(capsys, "plan", "-f", "-", "--json")
    assert code == 0
    assert json.loads(out)[0]["name"] == "llama3-8b"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("spec: [unclosed", "not valid YAML at line 1"),
        ("", "no DisaggregatedDeployment documents"),
        (
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
            "document 1 (c): skipped, not a DisaggregatedDeployment (v1 ConfigMap)",
        ),
        (
            "apiVersion: kvbridge.io/v2\nkind: DisaggregatedDeployment\nmetadata: {name: c}\n",
            "document 1 (c): expected apiVersion kvbridge.io/v1alpha1",
        ),
        (
            HETERO.read_text().replace("numLayers: 32", "numLayers: -3"),
            "document 1 (llama3-8b): spec.model.numLayers: Input should be greater than or equal to 1",
        ),
        (
            HETERO.read_text().replace("    headDim: 128\n", ""),
            "spec.model.headDim: required field 'headDim' is missing",
        ),
        ("- just\n- a list\n", "expected a mapping"),
        (HETERO.read_text().replace("numLayers: 32", "numLayers: " + "9" * 5000), "an integer of 5000 characters"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nests more than"),
    ],
)
def test_invalid_input_exits_2_with_a_message_naming_document_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(content)
    code, out, err = run(capsys, "plan", "-f", str(manifest), "--json")
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    for entry in json.loads(out) if out else []:  # each invalid document is an object with its errors
        assert entry["invalid"] is True
        assert entry["compatible"] is False
        assert entry["problems"][0]["code"]
        assert message in entry["problems"][0]["message"] or message in err


def test_one_bad_document_does_not_hide_the_others_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = HETERO.read_text().replace("numLayers: 32", "numLayers: x").replace("name: llama3-8b", "name: bad")
    other = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\n"
    manifest = tmp_path / "mixed.yaml"
    manifest.write_text("---\n".join([HETERO.read_text(), bad, other, INCOMPATIBLE.read_text()]))
    code, out, err = run(capsys, "plan", "-f", str(manifest), "--json")
    assert code == 2  # invalid input wins, but every valid document still gets its verdict
    found = [(e["name"], e["compatible"], e.get("invalid", False)) for e in json.loads(out)]
    assert found == [("llama3-8b", True, False), ("bad", False, True), ("replicated-heads", False, False)]
    bad = json.loads(out)[1]
    assert bad["document"].endswith("document 2 (bad)")
    assert bad["problems"] == [
        {"code": "INVALID_SPEC", "field": "spec.model.numLayers", "message": bad["problems"][0]["message"]}
    ]
    assert "spec.model.numLayers: Input should be a valid integer" in bad["problems"][0]["message"]
    assert "document 2 (bad): spec.model.numLayers: Input should be a valid integer" in err
    assert "document 3 (settings): skipped, not a DisaggregatedDeployment (v1 ConfigMap)" in err
    code, out, err = run(capsys, "plan", "-f", str(manifest))
    assert code == 2
    assert "llama3-8b: prefill TP 2" in out
    assert "replicated-heads: prefill TP 4" in out


def test_a_yaml_error_keeps_the_documents_before_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(HETERO.read_text() + "---\nspec: [unclosed\n")
    code, out, err = run(capsys, "plan", "-f", str(manifest), "--json")
    assert code == 2
    assert [(e["name"], e.get("invalid", False)) for e in json.loads(out)] == [("llama3-8b", False), (None, True)]
    assert "documents from 2 on" in err
    assert "not valid YAML" in err


def test_missing_file_and_rank_out_of_range_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "-f", "/nonexistent/x.yaml")
    assert code == 2
    assert "cannot read /nonexistent/x.yaml" in err
    code, _, err = run(capsys, "plan", "-f", str(HETERO), "--decode-rank", "1")
    assert code == 2
    assert "--decode-rank 1 is outside the decode ranks 0..0" in err


def test_console_script_runs_as_a_process() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(INCOMPATIBLE), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)[0]["problems"][0]["code"] == "PREFILL_HEADS_REPLICATED"


def test_a_reader_that_goes_away_is_not_an_invalid_input(tmp_path: Path) -> None:
    """``kvbridge plan ... | head -1``: the first line arrives, then the command stops quietly with the status a
    command SIGPIPE ended has (141), never 2 (invalid input)."""
    many = tmp_path / "many.yaml"  # far more output than a pipe buffers
    many.write_text("\n---\n".join(HETERO.read_text().replace("name: llama3-8b", f"name: n{i}") for i in range(300)))
    plan = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(many), "--all-ranks"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert plan.stdout is not None
    assert plan.stderr is not None
    first = plan.stdout.readline()
    plan.stdout.close()  # the reader is gone; the rest does not fit the pipe's buffer
    status = plan.wait(timeout=60)
    err = plan.stderr.read().decode()
    plan.stderr.close()
    assert first.startswith(b"n0: ")
    assert status == 141, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "code", "message"),
    [
        ("[" * 10_000, "BAD_YAML", "nests more than 64 levels"),
        ("a:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 1500)), "BAD_YAML", "nests more than 64 levels"),
        ("a: &x [1, 2]\nb: *x\n", "BAD_YAML", "aliases (*name) are not allowed"),
        (
            HETERO.read_text().replace("  numLayers: 32", "  numLayers: 32\n    numLayers: 16"),
            "BAD_YAML",
            "duplicate key 'numLayers'",
        ),
        (HETERO.read_text() + "\n" + "#" * (5 << 20), "TOO_LARGE", "larger than 4 MiB"),
    ],
    ids=["deep-lists", "deep-mappings", "alias", "duplicate-key", "too-large"],
)
def test_hostile_yaml_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, code: str, message: str
) -> None:
    """Issue 13 #8: these used to end in a traceback and exit 1, or be accepted (duplicate keys, aliases)."""
    path = tmp_path / "hostile.yaml"
    path.write_text(content)
    status, out, err = run(capsys, "plan", "-f", str(path))
    assert status == 2, err
    assert message in err
    assert "Traceback" not in err
    assert out == ""


def test_an_alias_bomb_is_refused_quickly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(levels) + "\n")
    started = time.monotonic()
    status, _, err = run(capsys, "plan", "-f", str(path))
    assert status == 2
    assert "aliases" in err
    assert time.monotonic() - started < 2


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge_operator import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvbridge {__version__}"


def test_a_folder_plans_every_manifest_in_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 13 #16: `plan -f DIR` reads every YAML file in it, as kubectl does."""
    (tmp_path / "b.yaml").write_text(INCOMPATIBLE.read_text())
    (tmp_path / "a.yml").write_text(HETERO.read_text())
    (tmp_path / "notes.txt").write_text("not a manifest")
    code, out, _ = run(capsys, "plan", "-f", str(tmp_path), "--json")
    assert code == 1  # one of them is incompatible
    assert [entry["name"] for entry in json.loads(out)] == ["llama3-8b", "replicated-heads"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "plan", "-f", str(empty))
    assert code == 2
    assert "no .yaml, .yml, .json files" in err


def test_gpus_per_node_refuses_an_engine_no_node_can_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster's GPUs per node given on the command line (the operator's --gpus-per-node) for documents that
    state none: prefill TP 16 on 8-GPU nodes is refused with the field and what fits; without it, compatible."""
    big = (EXAMPLES / "deepseek-mla.yaml").read_text().replace("tensorParallelSize: 2", "tensorParallelSize: 16", 1)
    path = tmp_path / "big.yaml"
    path.write_text(big)
    code, out, _ = run(capsys, "plan", "-f", str(path), "--json")
    assert code == 0, out
    code, out, _ = run(capsys, "plan", "-f", str(path), "--json", "--gpus-per-node", "8")
    assert code == 1
    [entry] = json.loads(out)
    assert [(p["code"], p["field"]) for p in entry["problems"]] == [
        ("ROLE_DOES_NOT_FIT", "spec.prefill.tensorParallelSize")
    ]
    assert "at most 8" in entry["problems"][0]["message"]
    code, out, _ = run(capsys, "plan", "-f", str(path), "--gpus-per-node", "16")
    assert code == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "-f", str(path), "--gpus-per-node", "0"])
    assert exit_info.value.code == 2
    assert "--gpus-per-node: 0 is not at least 1" in capsys.readouterr().err


def test_all_documents_invalid_still_print_one_object_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = HETERO.read_text().replace("numLayers: 32", "numLayers: x")
    manifest = tmp_path / "bad.yaml"
    manifest.write_text("---\n".join([bad, bad.replace("name: llama3-8b", "name: other")]))
    code, out, _ = run(capsys, "plan", "-f", str(manifest), "--json")
    assert code == 2
    assert [(e["name"], e["invalid"]) for e in json.loads(out)] == [("llama3-8b", True), ("other", True)]


def test_unknown_top_level_fields_are_warned_of(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "typo.yaml"
    manifest.write_text(HETERO.read_text() + "specc: {decode: {replicas: 3}}\n")
    code, out, err = run(capsys, "plan", "-f", str(manifest), "--json")
    assert code == 0
    assert "warning:" in err
    assert "unknown top-level field 'specc' is ignored" in err
    assert all("unknown top-level field 'specc'" in e["warnings"][0] for e in json.loads(out))
    code, _, err = run(capsys, "plan", "-f", str(HETERO), "--json")
    assert "warning" not in err
