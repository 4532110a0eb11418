"""Reading DisaggregatedDeployment manifests from files (multi-document YAML, ``-`` for stdin)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from kvbridge_agent.core import SpecError

from .spec import DisaggregatedDeployment, parse_deployment


class ManifestError(SpecError):
    """A manifest file cannot be read or a document in it is not a valid DisaggregatedDeployment."""

    code = "INVALID_MANIFEST"


def read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}", field=path, code="UNREADABLE") from exc
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path} is not UTF-8 text", field=path, code="UNREADABLE") from exc


def load_deployments(path: str) -> list[DisaggregatedDeployment]:
    """Every DisaggregatedDeployment in the file, in order; empty documents are skipped."""
    source = "stdin" if path == "-" else path
    text = read_text(path)
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError(f"{source}: not valid YAML{where}: {problem}", field=source, code="BAD_YAML") from exc
    if not documents:
        raise ManifestError(f"{source}: no DisaggregatedDeployment documents found", field=source, code="EMPTY")
    deployments = []
    for index, document in enumerate(documents, start=1):
        name = document.get("metadata", {}).get("name") if isinstance(document, dict) else None
        label = f"{source}: document {index}" + (f" ({name})" if isinstance(name, str) else "")
        try:
            deployments.append(parse_deployment(document))
        except SpecError as exc:
            raise ManifestError(f"{label}: {exc.message}", field=exc.field, code=exc.code) from exc
    return deployments
