"""``kvbridge plan``'s sections beyond the transfer plan: verification, the router, the planner, data and expert
parallelism and tracing, each as the text report says it and as ``--json`` carries it, and its notes."""

from __future__ import annotations

from kvbridge_agent.core import Role, Verification
from kvbridge_agent.core.parallel import kv_words, role_parallelism
from kvbridge_agent.core.tracing import SAMPLER
from kvbridge_operator.api.names import router_peers_name, router_token_secret_name
from kvbridge_operator.api.router_settings import peer_interval_for
from kvbridge_operator.api.spec import Connector, DisaggregatedDeployment, DisaggregatedDeploymentSpec, EngineDevice
from kvbridge_operator.children import peer_key, tracing, transfer_token
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.objects.router import router_placement, router_spread

#: what plan says of the layouts wherever kvbridge's connector runs on GPUs (docs/vllm.md, "The layouts")
LAYOUTS_NOTE = (
    "layouts: kvbridge renders one vLLM KVCacheLayout per role from kvLayout and cacheKind — LBHNC (HND), LBNHC "
    "(NHD), BHLNC (cacheKind CrossLayer) — and the connector starts only on the one rendered; LHBNC, BLHNC and BLNHC "
    "have no words in the spec (vLLM 0.32 picks them only for ROCm attention backends, Blackwell's trtllm-gen "
    "kernels and models with mixed page sizes), though the connector moves all six, and all 36 pairs, byte-exact "
    "on vLLM's allocator."
)


def notes_of(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The plan's notes (``--json``'s ``notes``, a line each in the text): the layouts where kvbridge's connector
    runs vLLM on GPUs."""
    on_gpus = spec.engine.device is EngineDevice.GPU
    return [LAYOUTS_NOTE] if on_gpus and engine_of(spec).connector(spec) is Connector.KVBRIDGE else []


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
        "tolerancePercent": auto.tolerance_percent,
        "reversalWindowSeconds": auto.reversal_window_seconds,
        "warmupSeconds": auto.warmup_seconds,
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


def router_lines(deployment: DisaggregatedDeployment) -> list[str]:
    """The text report's lines on kvbridge's router (none when it is off)."""
    spec = deployment.spec
    if not spec.router.enabled:
        return []
    replicas = f"{spec.router.replicas} replica{'s' if spec.router.replicas != 1 else ''}"
    if router_spread(spec.router, {}):
        replicas += " spread over nodes where possible"
    if peer_key.peers(spec):
        interval = peer_interval_for(spec.router.replicas)
        replicas += (
            f", each telling the others every {interval:g} s what it routes (Service "
            f"{router_peers_name(deployment.metadata.name)}, reports signed with the key of the Secret of that name)"
        )
    return [
        f"  router: {router_words(deployment)}",
        f"  router clients: {router_auth_words(deployment)}",
        f"  router pods: {replicas}; placement: {router_placement_words(deployment)}",
    ]
