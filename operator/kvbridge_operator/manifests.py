"""Reading DisaggregatedDeployment manifests from files (multi-document YAML, ``-`` for stdin).

Manifests are untrusted input: the size is capped before parsing, nesting is bounded, duplicate keys are refused
(as kubectl refuses them) and YAML anchors/aliases are refused (no alias-expansion bombs).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode

from kvbridge_agent.core import SpecError

from .spec import DisaggregatedDeployment, parse_deployment


class ManifestError(SpecError):
    """A manifest file cannot be read or a document in it is not a valid DisaggregatedDeployment."""

    code = "INVALID_MANIFEST"


#: the largest manifest read (the Kubernetes API server's own request limit is 3 MiB)
MAX_MANIFEST_BYTES = 4 << 20
#: how deeply a manifest may nest (a DisaggregatedDeployment with a pod template overlay needs about 15)
MAX_DEPTH = 64


def source_name(path: str) -> str:
    return "stdin" if path == "-" else path


def read_text(path: str) -> str:
    """The file's text (stdin for ``-``), at most :data:`MAX_MANIFEST_BYTES`."""
    source = source_name(path)
    try:
        if path == "-":
            binary = getattr(sys.stdin, "buffer", None)  # a text stream without one (tests): read characters
            data = binary.read(MAX_MANIFEST_BYTES + 1) if binary else sys.stdin.read(MAX_MANIFEST_BYTES + 1).encode()
        else:
            with open(path, "rb") as handle:
                data = handle.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}", field=path, code="UNREADABLE") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest kvbridge reads (the API server "
            "refuses objects this large too)", field=source, code="TOO_LARGE",
        )  # fmt: skip
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{source} is not UTF-8 text", field=source, code="UNREADABLE") from exc


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, anchors/aliases and nesting deeper than :data:`MAX_DEPTH`."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases (*name) are not allowed in manifests; write the value out", event.start_mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise yaml.constructor.ConstructorError(
                    None, None, f"the document nests more than {MAX_DEPTH} levels deep", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (kubectl refuses it too)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_documents(text: str, source: str) -> list[Any]:
    """The non-empty YAML documents of a manifest, parsed strictly (see :class:`_StrictLoader`)."""
    try:
        return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError(f"{source}: not valid YAML{where}: {problem}", field=source, code="BAD_YAML") from exc
    except RecursionError as exc:
        raise ManifestError(f"{source}: the document nests too deeply", field=source, code="BAD_YAML") from exc


#: file names ``-f DIR`` reads, as kubectl does
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def manifest_files(path: str) -> list[str]:
    """``path`` itself, or for a folder every manifest file in it (sorted, not recursive), as ``kubectl -f``."""
    if path == "-" or not Path(path).is_dir():
        return [path]
    found = sorted(str(p) for p in Path(path).iterdir() if p.is_file() and p.suffix in MANIFEST_SUFFIXES)
    if not found:
        raise ManifestError(f"{path}: no {', '.join(MANIFEST_SUFFIXES)} files in this folder", field=path,
                            code="EMPTY")  # fmt: skip
    return found


def load_deployments(path: str) -> list[DisaggregatedDeployment]:
    """Every DisaggregatedDeployment in the file (or in every manifest file of the folder), in order; empty
    documents are skipped."""
    found: list[DisaggregatedDeployment] = []
    for file in manifest_files(path):
        source = source_name(file)
        found += deployments_of(parse_documents(read_text(file), source), source)
    return found


def deployments_of(documents: list[Any], source: str) -> list[DisaggregatedDeployment]:
    """Validate parsed documents as DisaggregatedDeployments."""
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
