"""``kvbridge plan``: what the core decides for each document and decode rank, as JSON or a table."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import KVBridgeError, Problem, Role, SpecError, TransferPlan
from kvbridge_agent.core.parallel import ranks_words
from kvbridge_operator.api.images import overlay_image
from kvbridge_operator.api.names import ENGINE_CONTAINER
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import Connector, DisaggregatedDeployment, DisaggregatedDeploymentSpec
from kvbridge_operator.api.transfer import Memlock
from kvbridge_operator.children import multinode, network
from kvbridge_operator.children.engines import ServedEngine, engine_of
from kvbridge_operator.children.objects.pod import pod_template
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.remedy import Fix, describe, merge_patch, suggested_fix
from kvbridge_operator.children.verdict import advisories_for, verdict_for
from kvbridge_operator.cli.plan_sections import (
    autoscaling_of,
    autoscaling_words,
    notes_of,
    parallelism_lines,
    router_lines,
    router_of,
    tracing_of,
    tracing_words,
    verification_of,
    verification_words,
)
from kvbridge_operator.cli.provenance import provenance, provenance_lines
from kvbridge_operator.config import OperatorConfig, flag_of, settings


@dataclass(frozen=True)
class DocumentPlan:
    """One document's verdict: its plan, or the problems that prevent one."""

    name: str
    deployment: DisaggregatedDeployment
    plan: TransferPlan | None
    problems: tuple[Problem, ...]
    #: for an incompatible document: field changes that make it compatible (checked), when the search finds some
    fix: Fix | None = None
    #: what the manifest says that the API server would drop (unknown top-level fields)
    warnings: tuple[str, ...] = ()
    #: what the engines will run other than the spec asks, without refusing it (verdict.advisories_for)
    advisories: tuple[Problem, ...] = ()

    @property
    def compatible(self) -> bool:
        return self.plan is not None


def plan_document(deployment: DisaggregatedDeployment, warnings: tuple[str, ...] = ()) -> DocumentPlan:
    result = verdict_for(deployment)
    advised = tuple(advisories_for(deployment.spec))
    name = deployment.metadata.name
    if isinstance(result, list):
        return DocumentPlan(name, deployment, None, tuple(result), suggested_fix(deployment), warnings, advised)
    return DocumentPlan(name, deployment, result, (), warnings=warnings, advisories=advised)


def invalid_entry(label: str, name: str, error: KVBridgeError) -> dict[str, object]:
    """The JSON object of a document that is not a valid DisaggregatedDeployment: like an incompatible plan's, with
    ``invalid: true`` and the document's place (``name`` is null where the document has none)."""
    return {
        "name": name or None,
        "document": label,
        "compatible": False,
        "invalid": True,
        "problems": [{"code": error.code, "field": error.field, "message": error.message}],
    }


def selected_ranks(document: DocumentPlan, decode_rank: int | None, all_ranks: bool) -> list[int]:
    """Decode ranks to report for a document (rank 0 unless told otherwise)."""
    tp_decode = document.deployment.spec.decode.tensor_parallel_size
    if all_ranks:
        return list(range(tp_decode))
    rank = 0 if decode_rank is None else decode_rank
    if not 0 <= rank < tp_decode:
        raise SpecError(
            f"--decode-rank {rank} is outside the decode ranks 0..{tp_decode - 1} of {document.name!r}",
            field="spec.decode.tensorParallelSize",
            code="DECODE_RANK_OUT_OF_RANGE",
        )
    return [rank]


def entries(document: DocumentPlan, ranks: Iterable[int]) -> list[dict[str, object]]:
    """The JSON objects of docs/cli.md, one per decode rank."""
    result: list[dict[str, object]] = []
    # the same for every decode rank (and it renders both roles' pods): built once per document
    engines = engine_commands(document)
    for rank in ranks:
        entry: dict[str, object]
        if document.plan is None:
            entry = {
                "name": document.name,
                "decodeRank": rank,
                "compatible": False,
                "problems": [problem.to_dict() for problem in document.problems],
                "engine": engine_object(document.deployment.spec),
                "images": images_of(document.deployment),
            }
            if document.fix:
                entry["suggestedFix"] = document.fix
            result.append(entry)
        else:
            entry = {
                "name": document.name,
                **document.plan.for_decode_rank(rank).to_dict(),
                "pairing": pairing(document.deployment.spec),
                "engine": engine_object(document.deployment.spec),
                "images": images_of(document.deployment),
                "verification": verification_of(document.deployment.spec),
                "router": router_of(document.deployment),
                "autoscaling": autoscaling_of(document.deployment.spec),
                "tracing": tracing_of(document.deployment),
            }
            if engines:
                entry[engine_of(document.deployment.spec).name] = engines
            result.append(entry)
        entry["advisories"] = [advisory.to_dict() for advisory in document.advisories]
        notes = notes_of(document.deployment.spec)
        if notes:
            entry["notes"] = notes
        if document.warnings:
            entry["warnings"] = list(document.warnings)
    return result


def engine_commands(document: DocumentPlan, config: OperatorConfig | None = None) -> dict[str, dict[str, Any]]:
    """For an engine kind that serves a model (``engine: VLLM``): the exact command (``vllm serve``'s arguments)
    and environment each role's pods get (``config`` defaults to the operator's defaults: image, ports, GPU
    resource, no routing sidecar); empty for an incompatible document or a kind that prints none."""
    return {role: printed for role, (_, printed) in _served_commands(document, config or OperatorConfig()).items()}


def _served_commands(document: DocumentPlan, config: OperatorConfig) -> dict[str, tuple[ServedEngine, dict[str, Any]]]:
    """Each role's engine process (the engine kind's) and what :func:`engine_commands` prints of it."""
    if document.plan is None:
        return {}
    out: dict[str, tuple[ServedEngine, dict[str, Any]]] = {}
    spec = document.deployment.spec
    for role in (Role.PREFILL, Role.DECODE):
        engine = engine_of(spec).served(document.deployment, role, document.plan, config)
        if engine is None:
            return {}
        template = pod_template(document.deployment, role, document.plan, config)
        container = next(c for c in template["spec"]["containers"] if c["name"] == ENGINE_CONTAINER)
        command = list(container["command"])  # what runs the program, read from the pod (launchers, checks)
        program = engine.program
        launcher = command[: -len(program)] if command[-len(program) :] == program else list(engine.launcher)
        out[role.value.lower()] = (
            engine,
            {
                "command": [*launcher, *engine.command[len(engine.launcher) :]],
                "launcher": launcher,
                "env": {
                    **engine.env,
                    **{k: f"<{v}>" for k, v in engine.downward.items()},
                    **network.environment(spec),
                    **overlay_env(spec.role(role).template),
                },
                "kvTransferConfig": engine.kv_transfer_config,
                "environment": container_environment(container),
            },
        )
    return out


def container_environment(container: Obj) -> dict[str, str]:
    """The engine container's whole environment as the rendered pod has it (kvbridge's contract, vLLM's settings,
    the model source's, the network's, the overlay's): what running the role outside Kubernetes needs. A value
    the pod takes from elsewhere is named: ``<metadata.name>``, ``<status.podIP>`` (downward API),
    ``<secretKeyRef NAME/KEY>``."""
    found: dict[str, str] = {}
    for variable in container.get("env") or []:
        source = variable.get("valueFrom") or {}
        if "value" in variable:
            found[variable["name"]] = str(variable["value"])
        elif "fieldRef" in source:
            found[variable["name"]] = f"<{source['fieldRef']['fieldPath']}>"
        elif source:
            kind, ref = next(iter(source.items()))
            found[variable["name"]] = f"<{kind} {ref.get('name', '')}/{ref.get('key', '')}>"
    return found


def _table(header: tuple[str, ...], rows: list[tuple[object, ...]], indent: str = "    ") -> list[str]:
    cells = [header, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def engine_words(spec: DisaggregatedDeploymentSpec) -> str:
    """What runs the engines, in the plan's first line: ``vLLM on GPU, NixlConnector``, ``synthetic engine on CPU,
    serves no model`` (the engine kind's words)."""
    return engine_of(spec).words(spec)


def engine_object(spec: DisaggregatedDeploymentSpec) -> dict[str, object]:
    """The ``engine`` object of the JSON entries: the kind, the device, the kind's own fields (for vLLM the
    connector and ``kvBufferDevice``) and what has been run for real of this configuration (``provenance``)."""
    return {
        "kind": spec.engine.kind.value,
        "device": spec.engine.device.value,
        **engine_of(spec).described(spec),
        "provenance": provenance(spec),
    }


def engine_lines(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The text report's lines on the engine kind, right after the first (the synthetic engine: it serves no
    model)."""
    return engine_of(spec).report_lines(spec)


def images_of(deployment: DisaggregatedDeployment, config: OperatorConfig | None = None) -> dict[str, dict[str, str]]:
    """Each role's engine image as its pods will run it, and where it comes from (``source``): the role's template
    overlay (``spec.<role>.template``), ``spec.engine.image``, or the operator's default (its flag; ``config``
    defaults to the operator's defaults)."""
    spec = deployment.spec
    default, setting = engine_of(spec).default_image(spec, config or OperatorConfig())
    flag = next(flag_of(item) for item in settings() if item.name == setting)
    found: dict[str, dict[str, str]] = {}
    for role in Role:
        overlay = overlay_image(spec.role(role).template)
        if overlay:
            found[role.value] = {"image": overlay, "source": f"spec.{role.value}.template"}
        elif spec.engine.image:
            found[role.value] = {"image": spec.engine.image, "source": "spec.engine.image"}
        else:
            found[role.value] = {"image": default, "source": flag}
    return found


def image_lines(deployment: DisaggregatedDeployment) -> list[str]:
    """The text report's image line: the image of each role (one line when both run the same)."""
    found = images_of(deployment)

    def said(entry: dict[str, str]) -> str:
        source = entry["source"]
        return f"{entry['image']} ({source if source.startswith('spec.') else 'the operator default, ' + source})"

    spec = deployment.spec
    own = engine_of(spec).connector(spec) is Connector.KVBRIDGE
    needs = "; it must have kvbridge installed, as kvbridge's engine image has (docs/install.md)" if own else ""
    if found[Role.PREFILL.value] == found[Role.DECODE.value]:
        return [f"  image: {said(found[Role.PREFILL.value])} for both roles{needs}"]
    return [f"  images: prefill {said(found[Role.PREFILL.value])}; decode {said(found[Role.DECODE.value])}{needs}"]


def advisory_lines(document: DocumentPlan) -> list[str]:
    """The text report's advisories: what runs other than the spec asks (the spec is not refused for it)."""
    lines: list[str] = []
    for advisory in document.advisories:
        lines.append(f"  warning: {advisory.code} at {advisory.field}")
        lines.append(f"      {advisory.message}")
    return lines


def render_text(document: DocumentPlan, ranks: Iterable[int]) -> str:
    """The human-readable report for one document: what runs it (the engine kind, each role's image), then the
    problems and a checked fix, or the plan, its sections, each decode rank's reads and the engines' commands."""
    spec = document.deployment.spec
    head = (
        f"{document.name}: prefill {ranks_words(spec.prefill)} / block {spec.prefill.block_size}"
        f" {spec.prefill.kv_layout.value} -> decode {ranks_words(spec.decode)} / block {spec.decode.block_size}"
        f" {spec.decode.kv_layout.value}"
        f" ({spec.model.name}, {spec.model.attention.value}, {spec.model.cache_kind.value}; {engine_words(spec)})"
    )
    lines = [head, *engine_lines(spec), *image_lines(document.deployment)]
    notes = [f"  {note}" for note in notes_of(spec)]
    if document.plan is None:
        return "\n".join([*lines, *problem_lines(document), *advisory_lines(document), *notes])
    lines += plan_lines(document.plan, spec)
    lines += provenance_lines(spec)
    lines += notes
    lines += parallelism_lines(spec)
    lines += [f"  autoscaling: {autoscaling_words(spec)}"] if spec.autoscaling.enabled else []
    lines += advisory_lines(document)
    lines += router_lines(document.deployment)
    lines += [f"  tracing: {tracing_words(document.deployment)}"] if spec.tracing is not None else []
    lines += [line for rank in ranks for line in rank_lines(document.plan, rank)]
    lines += command_lines(document)
    return "\n".join(lines)


def problem_lines(document: DocumentPlan) -> list[str]:
    """An incompatible document's problems, each with its field and advice, and the checked fix for all."""
    lines = [f"  INCOMPATIBLE: {len(document.problems)} problem(s)"]
    for problem in document.problems:
        lines.append(f"  - {problem.code} at {problem.field}")
        lines.append(f"      {problem.message}")
    if document.fix:
        patch = json.dumps(merge_patch(document.fix), separators=(",", ":"))
        lines.append(f"  a fix for all of them at once, checked: {describe(document.fix)}")
        namespace = document.deployment.metadata.namespace
        where = f" -n {namespace}" if namespace else ""
        lines.append(f"      kubectl patch disaggregateddeployment {document.name}{where} --type merge -p '{patch}'")
    return lines


def plan_lines(plan: TransferPlan, spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The plan's own lines: its keys and ratios, the wire format, notifications, block bytes, verification."""
    conversions = (
        ", ".join(f"{s.side.value} {s.kind.value} {s.source}->{s.target}" for s in plan.wire.conversions) or "none"
    )
    return [
        f"  compatible  fingerprint {plan.fingerprint}  pairing {pairing(spec)}  tpRatio {plan.tp_ratio}"
        f"  blockSizeRatio {plan.block_size_ratio}",
        f"  wire format: {plan.wire.block_size}-token blocks, {plan.wire.layout.value}; conversions: {conversions}",
        f"  each prefill rank waits for {plan.notifications_per_prefill_rank} notification(s) per request;"
        f" prefill prefix caching {'allowed' if plan.wire.prefill_prefix_caching_allowed else 'must be off'}",
        f"  bytes per region block: local {plan.local_block_bytes}, remote wire {plan.remote_block_bytes}",
        f"  verification: {verification_words(spec)}",
    ]


def rank_lines(plan: TransferPlan, rank: int) -> list[str]:
    """One decode rank's handshakes and reads, as a table."""
    rank_plan = plan.for_decode_rank(rank)
    notify = ", ".join(map(str, rank_plan.notify_only_ranks)) or "-"
    rows: list[tuple[object, ...]] = [
        (r.prefill_rank, r.remote_offset, r.local_offset, r.length) for r in rank_plan.reads
    ]
    return [
        f"  decode rank {rank}: handshake ranks {', '.join(map(str, rank_plan.handshake_ranks))};"
        f" notify-only {notify}; {rank_plan.descriptors_per_block} descriptors per block",
        *_table(("prefill rank", "remote offset", "local offset", "length"), rows),
    ]


def command_lines(document: DocumentPlan) -> list[str]:
    """Each role's engine command and environment (for a kind that prints them), and how it spans nodes."""
    spec = document.deployment.spec
    kind = engine_of(spec)
    lines: list[str] = []
    for role, (served, engine) in _served_commands(document, OperatorConfig()).items():
        launcher = engine["launcher"]
        lines.append(f"  {kind.program} {role}: {shlex.join(engine['command'][len(launcher) :])}")
        if served.launcher_note:
            lines.append(f"      {served.launcher_note}")
        if spec.transfer.network.memlock is Memlock.REQUIRED:
            lines.append(
                "      (run through the memlock check: starts only under an unlimited locked-memory "
                "limit; `--json` shows it)"
            )
        lines.extend(f"      {name}={value}" for name, value in engine["env"].items())
        lines.extend(_nodes_lines(spec, Role(role)))
    return lines


def _nodes_lines(spec: DisaggregatedDeploymentSpec, role: Role) -> list[str]:
    """How one engine of the role spans nodes (none for an engine in one pod)."""
    nodes, role_spec = spec.role(role).nodes, spec.role(role)
    if nodes <= 1:
        return []
    gpus = multinode.gpus_per_pod(spec, role)
    if role_spec.data_parallel_size > 1:
        per_pod = multinode.data_parallel_per_pod(role_spec)
        return [
            f"      over {nodes} nodes: a LeaderWorkerSet group per engine, {gpus} GPUs and {per_pod} DP ranks per "
            f"pod; the leader serves the API and DP ranks 0-{per_pod - 1}, each worker adds --headless "
            f"--data-parallel-start-rank <worker index x {per_pod}>"
        ]
    return [
        f"      over {nodes} nodes: a LeaderWorkerSet group per engine, {gpus} GPUs per pod; the leader adds "
        f"{shlex.join(multinode.launch_args(nodes, True))}, each worker "
        f"{shlex.join(multinode.launch_args(nodes, False))}"
    ]


def overlay_env(template: dict[str, Any]) -> dict[str, str]:
    """The environment a role's template overlay adds to the engine container (kvbridge's own names cannot be
    overridden: children/templates.py), as the pod will have it; a value from elsewhere is shown as its source."""
    found: dict[str, str] = {}
    for container in (template.get("spec") or {}).get("containers") or []:
        if isinstance(container, dict) and container.get("name") == ENGINE_CONTAINER:
            for variable in container.get("env") or []:
                if isinstance(variable, dict) and isinstance(variable.get("name"), str):
                    source = next(iter(variable.get("valueFrom") or {}), "")
                    found[variable["name"]] = str(variable["value"]) if "value" in variable else f"<{source}>"
    return found
