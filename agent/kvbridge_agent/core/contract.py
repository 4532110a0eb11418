"""The environment contract between the operator and every engine pod.

The operator renders these variables into each prefill and decode pod; the
agent worker (and any engine that embeds the library) reads the same names.
Both sides use this one module, so the names cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from .admission import host_entry_problem, service_problem
from .errors import SpecError
from .model import CamelModel, ModelGeometry, Role, RoleSettings, TransferSettings
from .parallel import engine_id_of_rank

PREFIX = "KVBRIDGE_"

#: variable name -> (section, field) of :class:`EngineEnvironment`
_MODEL_VARS = {
    "MODEL_NAME": "name",
    "NUM_LAYERS": "num_layers",
    "NUM_KV_HEADS": "num_kv_heads",
    "HEAD_DIM": "head_dim",
    "KV_CACHE_DTYPE": "kv_cache_dtype",
    "ATTENTION": "attention",
    "CACHE_KIND": "cache_kind",
    "NUM_EXPERTS": "num_experts",
}
_ROLE_VARS = {
    "TP_SIZE": "tensor_parallel_size",
    "BLOCK_SIZE": "block_size",
    "KV_LAYOUT": "kv_layout",
    "DP_SIZE": "data_parallel_size",
    "EXPERT_PARALLEL": "expert_parallel",
}
#: fields added after the first pods ran: rendered only where they differ from their default, so the pods of a
#: deployment that does not use them keep their environment (and their template revision) through an upgrade
_RENDERED_WHEN_SET = frozenset(
    {"num_experts", "data_parallel_size", "expert_parallel", "http_request_seconds", "http_max_connections"}
)
#: the synthetic engine's HTTP server: the default deadline of one request (its line, headers and body, from its
#: first byte) and the default cap on open connections (synthetic/http_bounds.py)
HTTP_REQUEST_SECONDS = 30.0
HTTP_MAX_CONNECTIONS = 256
_TRANSFER_VARS = {
    "SIDE_CHANNEL_PORT": "side_channel_port",
    "LEASE_SECONDS": "lease_seconds",
    "HANDSHAKE_TIMEOUT_SECONDS": "handshake_timeout_seconds",
    "CONVERSION": "conversion",
    "BACKENDS": "backends",
    "VERIFICATION": "verification",
    "VERIFICATION_FIRST_SECONDS": "verification_first_seconds",
    "VERIFICATION_FRACTION": "verification_fraction",
}
_ENGINE_VARS = {
    "ROLE": "role",
    "DEPLOYMENT": "deployment",
    "ENGINE_ID": "engine_id",
    "DP_INDEX": "dp_index",
    "SIDE_CHANNEL_HOST": "side_channel_host",
    "SIDE_CHANNEL_LISTEN_PORT": "side_channel_listen_port",
    "FINGERPRINT": "fingerprint",
    "KEYS_DIR": "keys_dir",
    "NUM_BLOCKS": "num_blocks",
    "HTTP_PORT": "http_port",
    "HTTP_HOST": "http_host",
    "DEVICE": "device",
    "TRANSFER_TIMEOUT_SECONDS": "transfer_timeout_seconds",
    "VERIFY": "verify",
    "BLOCK_ALLOCATION": "block_allocation",
    "DRAIN_SECONDS": "drain_seconds",
    "TRANSFER_TOKEN_FILE": "transfer_token_file",
    "PREFILL_HOSTS": "prefill_hosts",
    "PREFILL_SERVICE": "prefill_service",
    "HTTP_REQUEST_SECONDS": "http_request_seconds",
    "HTTP_MAX_CONNECTIONS": "http_max_connections",
}


def _service(name: str) -> str:
    problem = service_problem(name)
    if problem:
        raise ValueError(problem)
    return name


def _host_entry(entry: str) -> str:
    problem = host_entry_problem(entry)
    if problem:
        raise ValueError(problem)
    return entry


class BlockAllocation(StrEnum):
    """How the agent worker hands out free blocks: in order, or shuffled (fragmented, for benchmarks)."""

    SEQUENTIAL = "Sequential"
    SCATTERED = "Scattered"


class EngineEnvironment(CamelModel):
    """Everything an engine pod is told through its environment."""

    role: Role
    deployment: str = Field(default="local", min_length=1)
    engine_id: str = Field(min_length=1, description="Stable engine identity (the pod name).")
    dp_index: int = Field(default=0, ge=0, le=1024)
    model: ModelGeometry
    prefill: RoleSettings
    decode: RoleSettings
    transfer: TransferSettings = Field(default_factory=TransferSettings)
    side_channel_host: str = Field(default="127.0.0.1", min_length=1)
    side_channel_listen_port: int | None = Field(
        default=None, ge=0, le=65535, description="Overrides the listen port (0: any free port); local runs only."
    )
    fingerprint: str = Field(default="", description="Expected fingerprint; empty skips the check.")
    keys_dir: str = Field(default="", description="Directory with curve-public and curve-secret; empty: no CURVE.")
    num_blocks: int = Field(default=256, ge=1, le=1 << 24)
    http_port: int = Field(default=8000, ge=0, le=65535)
    http_host: str = Field(default="0.0.0.0", min_length=1, description="Address the HTTP API binds.")
    http_request_seconds: float = Field(
        default=HTTP_REQUEST_SECONDS,
        gt=0,
        le=3600,
        description="Agent worker: how long one HTTP request (line, headers, body) may take to arrive from its first "
        "byte; a slower one is cut off (408 or the connection closed).",
    )
    http_max_connections: int = Field(
        default=HTTP_MAX_CONNECTIONS,
        ge=1,
        le=65536,
        description="Agent worker: open HTTP connections at most (a thread each); one more is answered 503 "
        "TOO_MANY_CONNECTIONS with Retry-After and closed.",
    )
    device: str = Field(default="cpu", min_length=1)
    transfer_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    verify: bool = Field(
        default=True, description="Agent worker: write and verify synthetic content (off for benchmarks)."
    )
    drain_seconds: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Agent worker: on SIGTERM, how long the requests in flight may finish (new ones get 503).",
    )
    transfer_token_file: str | None = Field(
        default=None,
        description="Decode: a file holding the router's token (spec.router.signTransfers); set, the engine accepts "
        "kv_transfer_params only with the router's signature (core/signing.py). Unset or empty: any.",
    )
    prefill_hosts: list[Annotated[str, AfterValidator(_host_entry)]] | None = Field(
        default=None,
        max_length=64,
        description="Decode: the hosts its side channels may reach (comma-separated IP addresses, CIDR networks and "
        "DNS names, a name admitting the names under it; core/admission.py): transfer parameters naming another "
        "remoteHost fail, REMOTE_HOST_NOT_ALLOWED, before any connection. Unset or empty: any host.",
    )
    prefill_service: Annotated[str, AfterValidator(_service)] | None = Field(
        default=None,
        max_length=253,
        description="Decode: the DNS name of its deployment's prefill Service (headless; the operator renders "
        "<deployment>-prefill.<namespace>.svc): a remoteHost must be one of the addresses it resolves to (or a name "
        "under it that resolves into them), checked on the threads that connect (transfer/peers.py); another fails "
        "REMOTE_HOST_NOT_ALLOWED before any connection. Unset or empty: not checked.",
    )
    block_allocation: BlockAllocation = Field(
        default=BlockAllocation.SEQUENTIAL,
        description="Agent worker: Sequential block ids, or Scattered (a shuffled free list, as after long uptime).",
    )

    @field_validator("prefill_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @field_validator("prefill_service", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return (value.strip() or None) if isinstance(value, str) else value

    @property
    def own(self) -> RoleSettings:
        return self.prefill if self.role is Role.PREFILL else self.decode

    @property
    def side_channel_port(self) -> int:
        """``base port + data parallel index`` (docs/protocol.md §5), unless overridden."""
        if self.side_channel_listen_port is not None:
            return self.side_channel_listen_port
        return self.transfer.side_channel_port + self.dp_index

    def of_data_parallel_rank(self, rank: int) -> EngineEnvironment:
        """One data-parallel rank of this engine: its index, its engine id (``<engine>_dp<rank>`` where the role has
        several) and so its side channel on base port + rank (an overridden listen port is offset too, unless it is
        0: any free port)."""
        listen = self.side_channel_listen_port
        port = (listen if listen else self.transfer.side_channel_port) + rank
        if listen != 0 and port > 65535:  # 0: any free port, whatever the rank
            field = "KVBRIDGE_SIDE_CHANNEL_LISTEN_PORT" if listen else "spec.transfer.sideChannelPort"
            raise SpecError(
                f"data-parallel rank {rank} would listen on port {port}, past 65535: lower {field}",
                field=field,
                code="SIDE_CHANNEL_PORTS_OUT_OF_RANGE",
            )
        return self.model_copy(
            update={
                "dp_index": rank,
                "engine_id": engine_id_of_rank(self.engine_id, rank, self.own.data_parallel_size),
                "side_channel_listen_port": listen + rank if listen else listen,
            }
        )


def render_environment(env: EngineEnvironment) -> dict[str, str]:
    """The variables for one pod, as strings."""
    out: dict[str, str] = {}
    for var, name in _ENGINE_VARS.items():
        value = getattr(env, name)
        if not _rendered(env, name):
            continue
        if isinstance(value, list):
            out[PREFIX + var] = ",".join(value)
        elif value is not None:
            out[PREFIX + var] = str(_plain(value))
    for var, name in _MODEL_VARS.items():
        if _rendered(env.model, name):
            out[PREFIX + var] = str(_plain(getattr(env.model, name)))
    for role, settings in ((Role.PREFILL, env.prefill), (Role.DECODE, env.decode)):
        for var, name in _ROLE_VARS.items():
            if _rendered(settings, name):
                out[f"{PREFIX}{role.value.upper()}_{var}"] = str(_plain(getattr(settings, name)))
    for var, name in _TRANSFER_VARS.items():
        value = getattr(env.transfer, name)
        out[PREFIX + var] = ",".join(value) if isinstance(value, list) else str(_plain(value))
    return out


def _plain(value: object) -> object:
    return getattr(value, "value", value)


def _rendered(section: CamelModel, name: str) -> bool:
    return name not in _RENDERED_WHEN_SET or getattr(section, name) != type(section).model_fields[name].default


def parse_environment(environ: Mapping[str, str], **overrides: object) -> EngineEnvironment:
    """Read the contract from ``environ`` (``os.environ``); ``overrides`` win (CLI flags).

    Raises :class:`SpecError` naming the variable at fault.
    """
    data: dict[str, object] = {}
    for var, name in _ENGINE_VARS.items():
        if PREFIX + var in environ:
            data[name] = environ[PREFIX + var]
    model = {name: environ[PREFIX + var] for var, name in _MODEL_VARS.items() if PREFIX + var in environ}
    roles: dict[str, dict[str, str]] = {}
    for role in Role:
        roles[role.value] = {
            name: environ[f"{PREFIX}{role.value.upper()}_{var}"]
            for var, name in _ROLE_VARS.items()
            if f"{PREFIX}{role.value.upper()}_{var}" in environ
        }
    transfer: dict[str, object] = {}
    for var, name in _TRANSFER_VARS.items():
        if PREFIX + var in environ:
            raw = environ[PREFIX + var]
            transfer[name] = [b.strip() for b in raw.split(",") if b.strip()] if name == "backends" else raw
    data.update(model=model, transfer=transfer, **roles)
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    try:
        return EngineEnvironment.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = _variable_for(tuple(str(p) for p in error["loc"]))
        raise SpecError(f"{where}: {error['msg']}", field=where, code="INVALID_ENVIRONMENT") from exc


def _variable_for(loc: tuple[str, ...]) -> str:
    """The environment variable behind a validation error location (field names or CRD aliases)."""
    section, name = (loc[0], loc[1]) if len(loc) > 1 else ("", loc[0] if loc else "")
    tables: dict[str, tuple[dict[str, str], type[CamelModel]]] = {
        "model": (_MODEL_VARS, ModelGeometry),
        "transfer": (_TRANSFER_VARS, TransferSettings),
        "prefill": (_ROLE_VARS, RoleSettings),
        "decode": (_ROLE_VARS, RoleSettings),
        "": (_ENGINE_VARS, EngineEnvironment),
    }
    if section not in tables:
        section, name = "", section
    variables, model = tables[section]
    for var, field in variables.items():
        alias = model.model_fields[field].alias if field in model.model_fields else None
        if name in (field, alias, to_camel(field)):
            role = f"{section.upper()}_" if section in ("prefill", "decode") else ""
            return PREFIX + role + var
    return ".".join(loc)


class PairSpec(CamelModel):
    """The parts of a DisaggregatedDeployment spec that decide the transfer (engine and pod fields ignored)."""

    model: ModelGeometry
    transfer: TransferSettings = Field(default_factory=TransferSettings)
    prefill: RoleSettings = Field(default_factory=RoleSettings)
    decode: RoleSettings = Field(default_factory=RoleSettings)


#: the fields of a DisaggregatedDeployment that decide pods, not the transfer: the operator reads them, the agent not
_POD_FIELDS = {
    "prefill": ("replicas", "minReplicas", "maxReplicas", "nodes", "rollout", "extraArgs", "template"),
    "decode": ("replicas", "minReplicas", "maxReplicas", "nodes", "rollout", "extraArgs", "template"),
    "model": ("source", "tokenSecret", "cache"),
    "transfer": ("network",),
}


def pair_from_spec(spec: Mapping[str, object]) -> PairSpec:
    """Read a DisaggregatedDeployment ``spec`` (a mapping) for the agent; typed error naming the field."""
    data = {key: spec[key] for key in ("model", "transfer", "prefill", "decode") if key in spec}
    for name, pod_fields in _POD_FIELDS.items():
        section = data.get(name)
        if isinstance(section, Mapping):
            data[name] = {k: v for k, v in section.items() if k not in pod_fields}
    try:
        return PairSpec.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = "spec." + ".".join(str(p) for p in error["loc"])
        raise SpecError(f"{where}: {error['msg']}", field=where, code="INVALID_SPEC") from exc
