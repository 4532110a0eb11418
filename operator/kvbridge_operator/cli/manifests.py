"""Reading DisaggregatedDeployment manifests from files (multi-document YAML, ``-`` for stdin).

Manifests are untrusted input: the size is capped before parsing, nesting is bounded, duplicate keys are refused
(as kubectl refuses them) and YAML anchors/aliases are refused (no alias-expansion bombs).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.names import KIND
from kvbridge_operator.api.spec import DEPRECATED_KINDS, MAX_DEPTH, DisaggregatedDeployment, parse_deployment


class ManifestError(SpecError):
    """A manifest file cannot be read or a document in it is not a valid DisaggregatedDeployment."""

    code = "INVALID_MANIFEST"


#: the largest manifest read (the Kubernetes API server's own request limit is 3 MiB)
MAX_MANIFEST_BYTES = 4 << 20


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
            "refuses objects this large too)",
            field=source,
            code="TOO_LARGE",
        )
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


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer; one too long for Python to read (over 4300 digits) is a YAML error at its place, not a crash."""
    try:
        return int(yaml.constructor.SafeConstructor.construct_yaml_int(loader, node))
    except ValueError as exc:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(str(node.value))} characters is too long to read", node.start_mark
        ) from exc


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _yaml_error(exc: yaml.YAMLError, source: str) -> ManifestError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return ManifestError(f"{source}: not valid YAML{where}: {problem}", field=source, code="BAD_YAML")


def _documents(text: str, source: str) -> Iterator[Any]:
    """The non-empty YAML documents, one by one; a YAML error ends the stream (what follows cannot be trusted)."""
    try:
        for document in yaml.load_all(text, Loader=_StrictLoader):
            if document is not None:
                yield document
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from exc
    except RecursionError as exc:
        raise ManifestError(f"{source}: the document nests too deeply", field=source, code="BAD_YAML") from exc


def parse_documents(text: str, source: str) -> list[Any]:
    """The non-empty YAML documents of a manifest, parsed strictly (see :class:`_StrictLoader`)."""
    return list(_documents(text, source))


#: file names ``-f DIR`` reads, as kubectl does
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def manifest_files(path: str) -> list[str]:
    """``path`` itself, or for a folder every manifest file in it (sorted, not recursive), as ``kubectl -f``."""
    if path == "-" or not Path(path).is_dir():
        return [path]
    found = sorted(str(p) for p in Path(path).iterdir() if p.is_file() and p.suffix in MANIFEST_SUFFIXES)
    if not found:
        raise ManifestError(f"{path}: no {', '.join(MANIFEST_SUFFIXES)} files in this folder", field=path, code="EMPTY")
    return found


@dataclass(frozen=True)
class Document:
    """One document of the input: a DisaggregatedDeployment, a document kvbridge skips (another kind), or
    the error that keeps it (or, for a YAML error, the rest of its file) from being read."""

    label: str
    deployment: DisaggregatedDeployment | None = None
    skipped: str = ""
    error: ManifestError | None = None
    name: str = ""  # metadata.name, where the document has one
    warnings: tuple[str, ...] = ()


#: the top-level fields of a custom resource; the API server drops any other (kubectl warns of them)
TOP_LEVEL_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")


def unknown_fields(document: Any) -> tuple[str, ...]:
    """What a document says at its top level that the API server would drop without a word."""
    if not isinstance(document, dict):
        return ()
    return tuple(
        f"unknown top-level field {key!r} is ignored (a DisaggregatedDeployment has {', '.join(TOP_LEVEL_FIELDS)})"
        for key in document
        if key not in TOP_LEVEL_FIELDS
    )


def deprecated_words(document: Any) -> tuple[str, ...]:
    """What a document says in a former spelling that is still read (an engine kind's former name)."""
    spec = document.get("spec") if isinstance(document, dict) else None
    engine = spec.get("engine") if isinstance(spec, dict) else None
    kind = engine.get("kind") if isinstance(engine, dict) else None
    if isinstance(kind, str) and kind in DEPRECATED_KINDS:
        now = DEPRECATED_KINDS[kind].value
        return (f"spec.engine.kind: {kind} is the former name of {now}, read as {now} (deprecated): write {now}",)
    return ()


def _name(document: Any) -> str:
    metadata = document.get("metadata") if isinstance(document, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) else ""


def _label(source: str, index: int, document: Any) -> str:
    name = _name(document)
    return f"{source}: document {index}" + (f" ({name})" if name else "")


def read_documents(path: str) -> list[Document]:
    """Every document of the file (or of every manifest file of the folder), each with its own verdict on
    validity: one bad document does not hide the others. Documents of other kinds are skipped, named by kind."""
    found: list[Document] = []
    for file in manifest_files(path):
        source = source_name(file)
        index = 0
        try:
            for index, document in enumerate(_documents(read_text(file), source), start=1):
                label = _label(source, index, document)
                kind = document.get("kind") if isinstance(document, dict) else None
                if isinstance(kind, str) and kind != KIND:
                    found.append(Document(label, skipped=f"{document.get('apiVersion', '?')} {kind}"))
                    continue
                name = _name(document)
                try:
                    found.append(
                        Document(
                            label,
                            deployment=parse_deployment(document),
                            name=name,
                            warnings=unknown_fields(document) + deprecated_words(document),
                        )
                    )
                except SpecError as exc:
                    found.append(
                        Document(
                            label,
                            error=ManifestError(f"{label}: {exc.message}", field=exc.field, code=exc.code),
                            name=name,
                        )
                    )
        except ManifestError as exc:
            if index:  # the documents before the error were read; say where reading stopped
                where = f"{source}: documents from {index + 1} on"
                exc = ManifestError(exc.message.replace(source, where, 1), field=exc.field, code=exc.code)
            found.append(Document(source, error=exc))
    return found


def deployments_of(documents: list[Any], source: str) -> list[DisaggregatedDeployment]:
    """Validate parsed documents as DisaggregatedDeployments."""
    if not documents:
        raise ManifestError(f"{source}: no DisaggregatedDeployment documents found", field=source, code="EMPTY")
    deployments = []
    for index, document in enumerate(documents, start=1):
        label = _label(source, index, document)
        try:
            deployments.append(parse_deployment(document))
        except SpecError as exc:
            raise ManifestError(f"{label}: {exc.message}", field=exc.field, code=exc.code) from exc
    return deployments
