"""What an engine kind answers (:class:`EngineKindModule`), and the pieces every kind shares.

An engine kind is one module of this package that provides every member of :class:`EngineKindModule` at module
level (mypy checks each module against the protocol where :data:`~kvbridge_operator.children.engines.ENGINES`
lists it). The rest of the operator asks ``engine_of(spec)`` instead of comparing ``spec.engine.kind``: the shared
checks (multi-node, placement, templates, ports, the fix search) ask for what a kind can do, the renderer for its
containers, the status for how its endpoints are named, ``kvbridge plan`` for its words and commands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvbridge_agent.core import Problem, Role, TransferPlan
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import Connector, DisaggregatedDeployment, DisaggregatedDeploymentSpec
from kvbridge_operator.config import OperatorConfig


@dataclass(frozen=True)
class ServedEngine:
    """One role's engine process as a pod runs it and ``kvbridge plan`` prints it: the command, the arguments and
    the kind's own environment."""

    #: what the kind serves with (``vllm serve``)
    program: list[str]
    args: list[str]
    env: dict[str, str]
    #: environment variables filled in by the downward API: name -> fieldPath
    downward: dict[str, str] = field(default_factory=dict)
    port: int = 8000
    #: the KV connector's configuration as the engine reads it (vLLM's ``--kv-transfer-config``)
    kv_transfer_config: Obj = field(default_factory=dict)
    #: what runs ``program`` (kvbridge's CPU launcher), empty when it runs itself
    launcher: list[str] = field(default_factory=list)
    #: the text report's note on the launcher (empty without one)
    launcher_note: str = ""

    @property
    def command(self) -> list[str]:
        """The container's whole command line (the pod's ``command`` + ``args``)."""
        return [*self.launcher, *self.program, *self.args]


class EngineKindModule(Protocol):
    """What one engine kind answers: the problems it refuses before scheduling, what it renders, its ports, health
    and metrics, and how ``kvbridge plan`` describes it."""

    #: the kind's name in code (its module; the key of its commands in ``kvbridge plan --json``)
    @property
    def name(self) -> str: ...

    #: what the reports call the program the engine runs (``vLLM``)
    @property
    def program(self) -> str: ...

    #: the HTTP path the engine answers 200 on once it serves (its probes)
    @property
    def health_path(self) -> str: ...

    #: what the engine's Prometheus names start with (``vllm:``); kvbridge's own gauges carry it too
    @property
    def metrics_prefix(self) -> str: ...

    #: whether ``spec.<role>.extraArgs`` reach the engine (else they are refused)
    @property
    def takes_extra_args(self) -> bool: ...

    #: the engine's own tracing flag, rendered when ``spec.tracing`` is set (empty: none)
    @property
    def tracing_flag(self) -> str: ...

    #: whether the engines serve the model the spec names (and so need its weights): vLLM does, the synthetic
    #: engine serves none (``kvbridge demo`` makes a model locally for the kinds that serve one)
    @property
    def serves_model(self) -> bool: ...

    #: the kind's name in the pairing key (``children/pairing.py``): its CRD value when its first pods ran, kept
    #: through a rename so that no pod's key changes (a new key would roll every such deployment blue/green)
    @property
    def pairing_name(self) -> str: ...

    # -- what it refuses before scheduling

    def problems(self, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
        """What the kind cannot run of a spec beyond the shared checks (reported after them)."""
        ...

    def parallelism_problems(self, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
        """Where the kind cannot run a role's data or expert parallelism (reported with the shared checks, after
        multi-node's)."""
        ...

    def advisories(self, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
        """What the engines will run other than the spec asks, without refusing it."""
        ...

    def spans_nodes(self, spec: DisaggregatedDeploymentSpec) -> bool:
        """Whether one engine of this kind (on the spec's device) may span nodes (a LeaderWorkerSet group)."""
        ...

    def refused_extra_args(self, spec: DisaggregatedDeploymentSpec) -> list[str]:
        """The arguments of ``spec.engine.extraArgs`` the kind refuses, which the fix search drops."""
        ...

    # -- what it renders

    def on_cpu(self, spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> bool:
        """Whether the engines keep their KV cache in host memory."""
        ...

    def connector(self, spec: DisaggregatedDeploymentSpec) -> Connector | None:
        """The KV connector the engines load (``spec.engine.connector``), ``None`` for a kind that loads none: with
        ``KVBridge`` the image must carry kvbridge (``api/spec.py``'s ``CONNECTOR_KINDS`` says which kinds load one,
        for the model's check and the CRD's rule, which cannot ask this package)."""
        ...

    def host_buffer(self, spec: DisaggregatedDeploymentSpec) -> bool:
        """Whether engines on GPUs stage their KV through a buffer in host memory (vLLM's ``kv_buffer_device:
        cpu``), which ``kvbridge plan``'s record of what was run for real tells apart."""
        ...

    def kvbridge_transfer(self, spec: DisaggregatedDeploymentSpec) -> bool:
        """Whether KV moves through kvbridge's transfer layer: the side channel with the key Secret (CURVE), engines
        named by their pods in the endpoints, transfer digests (verification), the held-requests gauge."""
        ...

    def ports(self, spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig) -> dict[int, str]:
        """The fixed ports one role's pod listens on besides the side channel, and what listens there."""
        ...

    def pod(
        self,
        dd: DisaggregatedDeployment,
        role: Role,
        plan: TransferPlan,
        config: OperatorConfig,
        env: list[Obj],
        side_channels: list[Obj],
        keys_volume: Obj,
    ) -> tuple[list[Obj], list[Obj]]:
        """A role's containers (the ``engine`` one among them) and volumes: ``env`` is kvbridge's environment
        contract, ``side_channels`` the side channels' container ports, ``keys_volume`` the key Secret's volume."""
        ...

    def pod_labels(
        self, spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig, deployment: str
    ) -> dict[str, str]:
        """Labels the kind adds to a role's pods (what other schedulers select them by)."""
        ...

    def default_image(self, spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> tuple[str, str]:
        """The image the engines run when ``spec.engine.image`` is empty, and the operator's setting it comes from
        (the field of :class:`~kvbridge_operator.config.OperatorConfig`)."""
        ...

    # -- how ``kvbridge plan`` describes it

    def words(self, spec: DisaggregatedDeploymentSpec) -> str:
        """What runs the engines, in the plan's first line."""
        ...

    def described(self, spec: DisaggregatedDeploymentSpec) -> dict[str, str]:
        """The kind's fields of the ``engine`` object of ``--json`` (after ``kind`` and ``device``)."""
        ...

    def report_lines(self, spec: DisaggregatedDeploymentSpec) -> list[str]:
        """The text report's lines on the engine kind, right after its first line (what the kind is for)."""
        ...

    def served(
        self, dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig
    ) -> ServedEngine | None:
        """The engine process ``kvbridge plan`` prints for a role; ``None`` where the plan prints none."""
        ...


def api_port(config: OperatorConfig) -> dict[int, str]:
    """The port every engine pod serves its HTTP API on (the operator's ``engineHttpPort``)."""
    return {config.engine_http_port: "the engine's HTTP API (the operator's engineHttpPort)"}
