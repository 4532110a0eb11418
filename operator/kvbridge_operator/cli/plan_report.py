"""``kvbridge plan``: what the core decides for each document and decode rank, as JSON or a table."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import KVBridgeError, Problem, Role, SpecError, TransferPlan, Verification
from kvbridge_agent.core.parallel import kv_words, ranks_words, role_parallelism
from kvbridge_agent.core.tracing import SAMPLER
from kvbridge_operator.api.names import ENGINE_CONTAINER, router_peers_name, router_token_secret_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, DisaggregatedDeploymentSpec
from kvbridge_operator.api.transfer import Memlock
from kvbridge_operator.children import multinode, network, peer_key, tracing, transfer_token
from kvbridge_operator.children.engines import ServedEngine, engine_of
from kvbridge_operator.children.objects.pod import pod_template
from kvbridge_operator.children.objects.router import router_placement, router_spread
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.remedy import Fix, describe, merge_patch, suggested_fix
from kvbridge_operator.children.verdict import advisories_for, verdict_for
from kvbridge_operator.config import OperatorConfig
from kvbridge_router.settings import peer_interval_for


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
                "verification": verification_of(document.deployment.spec),
                "router": router_of(document.deployment),
                "autoscaling": autoscaling_of(document.deployment.spec),
                "tracing": tracing_of(document.deployment),
            }
            if engines:
                entry[engine_of(document.deployment.spec).name] = engines
            result.append(entry)
        entry["advisories"] = [advisory.to_dict() for advisory in document.advisories]
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
    """What runs the engines, in the plan's first line: ``vLLM on GPU, NixlConnector``, ``synthetic engine (Agent)
    on CPU`` (the engine kind's words)."""
    return engine_of(spec).words(spec)


def engine_object(spec: DisaggregatedDeploymentSpec) -> dict[str, str]:
    """The ``engine`` object of the JSON entries: the kind, the device and the kind's own fields (for vLLM the
    connector, ``kvBufferDevice`` and, for kvbridge's connector, where it has been proven on this device)."""
    return {"kind": spec.engine.kind.value, "device": spec.engine.device.value, **engine_of(spec).described(spec)}


def engine_lines(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The text report's lines on the engine kind (kvbridge's connector: where it has been proven on the device)."""
    return engine_of(spec).report_lines(spec)


def advisory_lines(document: DocumentPlan) -> list[str]:
    """The text report's advisories: what runs other than the spec asks (the spec is not refused for it)."""
    lines: list[str] = []
    for advisory in document.advisories:
        lines.append(f"  warning: {advisory.code} at {advisory.field}")
        lines.append(f"      {advisory.message}")
    return lines


def verifies(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether the engines verify transfers at all: kvbridge's transfer layer does (kvbridge's connector, the
    synthetic engine; docs/protocol.md §8); vLLM's NixlConnector has no transfer digest."""
    return engine_of(spec).kvbridge_transfer(spec)


def verification_of(spec: DisaggregatedDeploymentSpec) -> dict[str, object]:
    """``spec.transfer.verification`` as the engines apply it (``--json``)."""
    transfer = spec.transfer
    return {
        "policy": transfer.verification.value if verifies(spec) else Verification.OFF.value,
        "firstSeconds": transfer.verification_first_seconds,
        "fraction": transfer.verification_fraction,
        "supported": verifies(spec),
    }


def verification_words(spec: DisaggregatedDeploymentSpec) -> str:
    transfer = spec.transfer
    if not verifies(spec):
        return "none (vLLM's NixlConnector has no transfer digest; connector: KVBridge verifies)"
    if transfer.verification is Verification.SAMPLED:
        return (
            f"Sampled (decode checks prefill's digest of every request for {transfer.verification_first_seconds}"
            f" s after a prefill engine's first, then of {transfer.verification_fraction:.0%})"
        )
    if transfer.verification is Verification.ALL:
        return "All (decode checks prefill's digest of every request)"
    return "Off"


def router_of(deployment: DisaggregatedDeployment) -> dict[str, object]:
    """``spec.router`` as it will run (``--json``): whether kvbridge's router runs, its policy, whether it signs
    decode's transfer parameters with the token of ``tokenSecret`` (empty when it does not), how many replicas,
    which clients it admits (``auth``) and where its pods run (``placement``: the pod fields rendered)."""
    router = deployment.spec.router
    signs = transfer_token.signs(deployment.spec)
    secret = router_token_secret_name(deployment.metadata.name) if signs else ""
    keys = router.api_key_secret
    auth: dict[str, object] = (
        {"apiKeys": True, "secret": keys.name, "key": keys.key} if keys is not None else {"apiKeys": False}
    )
    return {
        "enabled": router.enabled,
        "policy": router.policy.value,
        "signTransfers": signs,
        "tokenSecret": secret,
        "replicas": router.replicas,
        # the replicas' headless Service (their reports to each other), when there are two or more
        **({"peers": router_peers_name(deployment.metadata.name)} if peer_key.peers(deployment.spec) else {}),
        "auth": auth,
        "placement": router_placement(router),
    }


def autoscaling_of(spec: DisaggregatedDeploymentSpec) -> dict[str, object]:
    """``spec.autoscaling`` as the planner will run it (``--json``): off, or its targets, source and rhythm."""
    auto = spec.autoscaling
    if not auto.enabled or auto.ttft is None or auto.itl is None or auto.profile is None:
        return {"enabled": False}
    return {
        "enabled": True,
        "ttft": {"milliseconds": auto.ttft.milliseconds, "percentile": auto.ttft.percentile},
        "itl": {"milliseconds": auto.itl.milliseconds, "percentile": auto.itl.percentile},
        "prometheusUrl": auto.prometheus_url,
        "profile": {"configMap": auto.profile.name, "key": auto.profile.key},
        "intervalSeconds": auto.interval_seconds,
        "windowSeconds": auto.window_seconds,
        "headroomPercent": auto.headroom_percent,
        "stabilizationWindowSeconds": auto.stabilization_window_seconds,
        "bounds": {role.value: [spec.role(role).min_replicas, spec.role(role).max_replicas] for role in Role},
    }


def autoscaling_words(spec: DisaggregatedDeploymentSpec) -> str:
    """The planner's line of the text report."""
    auto = spec.autoscaling
    if not auto.enabled or auto.ttft is None or auto.itl is None or auto.profile is None:
        return "off (the roles' /scale is for HPA, KEDA or kubectl scale)"
    bounds = ", ".join(f"{r.value} {spec.role(r).min_replicas}-{spec.role(r).max_replicas}" for r in Role)
    return (
        f"planner to TTFT p{auto.ttft.percentile:g} {auto.ttft.milliseconds:g} ms and ITL p{auto.itl.percentile:g} "
        f"{auto.itl.milliseconds:g} ms, every {auto.interval_seconds} s from {auto.prometheus_url} (profile "
        f"ConfigMap {auto.profile.name}/{auto.profile.key}, {auto.headroom_percent}% headroom); {bounds}"
    )


def router_auth_words(deployment: DisaggregatedDeployment) -> str:
    """Which clients the router admits, in the text report's words."""
    keys = deployment.spec.router.api_key_secret
    if keys is None:
        return "any client that reaches its Service (no apiKeySecret)"
    return f"only with an API key of Secret {keys.name}, key {keys.key} (Authorization: Bearer; else 401)"


def router_placement_words(deployment: DisaggregatedDeployment) -> str:
    """Where the router's pods run, in the text report's words: each pod field set, else the cluster's defaults."""
    placement = router_placement(deployment.spec.router)
    if not placement:
        return "the cluster's defaults"
    words = {
        "imagePullSecrets": lambda v: "imagePullSecrets " + ", ".join(ref["name"] for ref in v),
        "nodeSelector": lambda v: "nodeSelector " + ", ".join(f"{k}={val}" for k, val in sorted(v.items())),
        "tolerations": lambda v: f"{len(v)} toleration{'s' if len(v) != 1 else ''}",
        "affinity": lambda v: "affinity " + ", ".join(sorted(v)),
        "priorityClassName": lambda v: f"priorityClassName {v}",
    }
    return "; ".join(words[key](value) for key, value in placement.items())


def router_words(deployment: DisaggregatedDeployment) -> str:
    """The router's line of the text report: its policy, and who decode takes transfer parameters from."""
    policy = deployment.spec.router.policy.value
    if not transfer_token.signs(deployment.spec):
        return f"{policy}; decode accepts kv_transfer_params from any pod that reaches it (signTransfers off)"
    secret = router_token_secret_name(deployment.metadata.name)
    return f"{policy}; decode accepts kv_transfer_params only as the router signs them (signTransfers, Secret {secret})"


def parallelism_lines(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The text report's lines on data and expert parallelism (none without either): each role's ranks, GPUs and
    side channels, then what they change for KV (``kvbridge_agent.core.parallel``)."""
    if not any(r.data_parallel_size > 1 or r.expert_parallel for r in (spec.prefill, spec.decode)):
        return []
    lines: list[str] = []
    for role in Role:
        ranks = role_parallelism(spec.role(role), spec.transfer)
        ports = ranks.side_channel_ports
        listened = str(ports[0]) if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
        experts = f", {ranks.world_size}-way expert parallel" if ranks.expert_parallel else ""
        lines.append(
            f"  {role.value}: {ranks.data_parallel_size} DP rank(s) x TP {ranks.tensor_parallel_size} = "
            f"{ranks.world_size} ranks per engine{experts}; side channels on {listened}"
        )
    lines.extend(f"  KV: {words}" for words in kv_words(spec.model, spec.prefill, spec.decode))
    return lines


def tracing_of(deployment: DisaggregatedDeployment) -> dict[str, object]:
    """``spec.tracing`` as the pods get it (``--json``): off, or the OTLP endpoint, protocol and sampling, each
    process's service name, and whether the engine's own flag (vLLM's) is rendered."""
    spec, name = deployment.spec, deployment.metadata.name
    if spec.tracing is None:
        return {"enabled": False}
    processes = [role.value for role in Role] + (["router"] if spec.router.enabled else [])
    return {
        "enabled": True,
        "endpoint": spec.tracing.endpoint,
        "protocol": spec.tracing.protocol.value,
        "samplingRatio": spec.tracing.sampling_ratio,
        "sampler": SAMPLER,
        "services": {process: tracing.service_name(name, process) for process in processes},
        "vllmFlag": bool(engine_of(spec).tracing_flag),
    }


def tracing_words(deployment: DisaggregatedDeployment) -> str:
    """The text report's tracing line: where spans go, how many new traces are kept, which processes send them."""
    spec, name = deployment.spec, deployment.metadata.name
    if spec.tracing is None:
        return "off"
    processes = [role.value for role in Role] + (["router"] if spec.router.enabled else [])
    services = ", ".join(tracing.service_name(name, process) for process in processes)
    kind = engine_of(spec)
    flag = f"; {kind.program} {kind.tracing_flag}" if kind.tracing_flag else ""
    return (
        f"OTLP {spec.tracing.protocol.value} to {spec.tracing.endpoint}, {spec.tracing.sampling_ratio:.0%} of new "
        f"traces (a caller's decision kept); services {services}{flag}"
    )


def render_text(document: DocumentPlan, ranks: Iterable[int]) -> str:
    """The human-readable report for one document."""
    spec = document.deployment.spec
    head = (
        f"{document.name}: prefill {ranks_words(spec.prefill)} / block {spec.prefill.block_size}"
        f" {spec.prefill.kv_layout.value} -> decode {ranks_words(spec.decode)} / block {spec.decode.block_size}"
        f" {spec.decode.kv_layout.value}"
        f" ({spec.model.name}, {spec.model.attention.value}, {spec.model.cache_kind.value}; {engine_words(spec)})"
    )
    if document.plan is None:
        lines = [head, f"  INCOMPATIBLE: {len(document.problems)} problem(s)"]
        for problem in document.problems:
            lines.append(f"  - {problem.code} at {problem.field}")
            lines.append(f"      {problem.message}")
        if document.fix:
            patch = json.dumps(merge_patch(document.fix), separators=(",", ":"))
            lines.append(f"  a fix for all of them at once, checked: {describe(document.fix)}")
            namespace = document.deployment.metadata.namespace
            where = f" -n {namespace}" if namespace else ""
            lines.append(
                f"      kubectl patch disaggregateddeployment {document.name}{where} --type merge -p '{patch}'"
            )
        return "\n".join([*lines, *advisory_lines(document)])
    plan = document.plan
    conversions = (
        ", ".join(f"{s.side.value} {s.kind.value} {s.source}->{s.target}" for s in plan.wire.conversions) or "none"
    )
    lines = [
        head,
        f"  compatible  fingerprint {plan.fingerprint}  pairing {pairing(spec)}  tpRatio {plan.tp_ratio}"
        f"  blockSizeRatio {plan.block_size_ratio}",
        f"  wire format: {plan.wire.block_size}-token blocks, {plan.wire.layout.value}; conversions: {conversions}",
        f"  each prefill rank waits for {plan.notifications_per_prefill_rank} notification(s) per request;"
        f" prefill prefix caching {'allowed' if plan.wire.prefill_prefix_caching_allowed else 'must be off'}",
        f"  bytes per region block: local {plan.local_block_bytes}, remote wire {plan.remote_block_bytes}",
        f"  verification: {verification_words(spec)}",
        *parallelism_lines(spec),
        *([f"  autoscaling: {autoscaling_words(spec)}"] if spec.autoscaling.enabled else []),
        *advisory_lines(document),
        *engine_lines(spec),
    ]
    if spec.router.enabled:
        lines.append(f"  router: {router_words(document.deployment)}")
        lines.append(f"  router clients: {router_auth_words(document.deployment)}")
        replicas = f"{spec.router.replicas} replica{'s' if spec.router.replicas != 1 else ''}"
        if router_spread(spec.router, {}):
            replicas += " spread over nodes where possible"
        if peer_key.peers(spec):
            interval = peer_interval_for(spec.router.replicas)
            replicas += (
                f", each telling the others every {interval:g} s what it routes (Service "
                f"{router_peers_name(document.deployment.metadata.name)}, reports signed with the key of the "
                "Secret of that name)"
            )
        lines.append(f"  router pods: {replicas}; placement: {router_placement_words(document.deployment)}")
    if spec.tracing is not None:
        lines.append(f"  tracing: {tracing_words(document.deployment)}")
    for rank in ranks:
        rank_plan = plan.for_decode_rank(rank)
        notify = ", ".join(map(str, rank_plan.notify_only_ranks)) or "-"
        lines.append(
            f"  decode rank {rank}: handshake ranks {', '.join(map(str, rank_plan.handshake_ranks))};"
            f" notify-only {notify}; {rank_plan.descriptors_per_block} descriptors per block"
        )
        rows: list[tuple[object, ...]] = [
            (r.prefill_rank, r.remote_offset, r.local_offset, r.length) for r in rank_plan.reads
        ]
        lines.extend(_table(("prefill rank", "remote offset", "local offset", "length"), rows))
    kind = engine_of(spec)
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
        nodes = spec.role(Role(role)).nodes
        per_pod = multinode.data_parallel_per_pod(spec.role(Role(role)))
        if nodes > 1 and spec.role(Role(role)).data_parallel_size > 1:
            lines.append(
                f"      over {nodes} nodes: a LeaderWorkerSet group per engine, "
                f"{multinode.gpus_per_pod(spec, Role(role))} GPUs and {per_pod} DP ranks per pod; the leader "
                f"serves the API and DP ranks 0-{per_pod - 1}, each worker adds --headless "
                f"--data-parallel-start-rank <worker index x {per_pod}>"
            )
        elif nodes > 1:
            lines.append(
                f"      over {nodes} nodes: a LeaderWorkerSet group per engine, "
                f"{multinode.gpus_per_pod(spec, Role(role))} GPUs per pod; the leader adds "
                f"{shlex.join(multinode.launch_args(nodes, True))}, each worker "
                f"{shlex.join(multinode.launch_args(nodes, False))}"
            )
    return "\n".join(lines)


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
