"""vLLM engines (``spec.engine.kind: VLLM``): what vLLM cannot honour, and the engine each role runs.

The renderer targets one vLLM release (:data:`VLLM_RELEASE`, also the chart's default image): its flags, its
environment variables and its names of KV layouts. Specs on ``engine.device: CPU`` run vLLM's CPU build.

Pure functions from a DisaggregatedDeployment and its plan to ``vllm serve`` arguments, the environment and
the container; :mod:`render` puts them into the pod template and ``kvbridge plan`` prints them. Everything the
compatibility rules decided shows up here: each role's TP size, block size and KV layout, the decode-side
permute the plan lists, the cross-layer cache kind, the side-channel port, the NIXL backends.

The ``--kv-transfer-config`` JSON is always generated (``json.dumps`` of a dict), never written by hand, and
``extraArgs`` may not override any argument this module sets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvbridge_agent.core import CacheKind, KVCacheDtype, KVLayout, Problem, Role, TransferPlan, Verification
from kvbridge_agent.core.compat import check_pair
from kvbridge_agent.core.layout import rendered_order
from kvbridge_agent.core.wire import ConversionKind, wire_format, wire_format_defined
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import (
    Connector,
    DisaggregatedDeployment,
    DisaggregatedDeploymentSpec,
    EngineDevice,
    KVBufferDevice,
    RoleSpec,
)
from kvbridge_operator.children import tracing
from kvbridge_operator.children import vllm_messages as words
from kvbridge_operator.children.model_source import SOURCE_ARGUMENTS, Weights, weights

# the vLLM release this renderer targets (config.VLLM_VERSION's minor release): the flags, variables and layout names
# below are that release's
from kvbridge_operator.config import VLLM_RELEASE as VLLM_RELEASE
from kvbridge_operator.config import OperatorConfig

VLLM_PREFILL_CONVERSION = "VLLM_PREFILL_CONVERSION"
VLLM_MANAGED_ARGUMENT = "VLLM_MANAGED_ARGUMENT"
VLLM_CPU_BLOCK_SIZE = "VLLM_CPU_BLOCK_SIZE"
VLLM_CPU_KV_LAYOUT = "VLLM_CPU_KV_LAYOUT"
VLLM_CPU_BLOCK_SIZE_RATIO = "VLLM_CPU_BLOCK_SIZE_RATIO"
VLLM_CPU_CACHE_KIND = "VLLM_CPU_CACHE_KIND"
VLLM_CPU_KV_CACHE_DTYPE = "VLLM_CPU_KV_CACHE_DTYPE"

VLLM_UNMODELLED_ARGUMENT = "VLLM_UNMODELLED_ARGUMENT"
VLLM_KVBRIDGE_REPLICATED_HEADS = "VLLM_KVBRIDGE_REPLICATED_HEADS"
#: kvBufferDevice cuda on vLLM's CPU build, which has no GPU memory to move the KV cache from
VLLM_KV_BUFFER_DEVICE = "VLLM_KV_BUFFER_DEVICE"
#: verification: All asked of vLLM's NixlConnector, which has no transfer digest (refused)
VLLM_NIXL_UNVERIFIED = "VLLM_NIXL_UNVERIFIED"
#: verification: Sampled (the default) with vLLM's NixlConnector: runs, unverified (an advisory, not a refusal)
VLLM_NIXL_UNVERIFIED_SAMPLED = "VLLM_NIXL_UNVERIFIED_SAMPLED"
#: router.signTransfers asked of vLLM's NixlConnector, which cannot check the router's signature
VLLM_NIXL_UNSIGNED = "VLLM_NIXL_UNSIGNED"
VLLM_MLA_BLOCK_SIZE = "VLLM_MLA_BLOCK_SIZE"
#: vLLM 0.32's MLA backend kvbridge renders on GPUs, and the only block size it runs (with another, vLLM would pick
#: another MLA backend by itself, whose cache the plan did not describe)
MLA_BACKEND = "FLASHMLA"
MLA_BLOCK_SIZE = 64

#: vLLM's data-parallel arguments (long and short names): kvbridge sets them from ``spec.<role>.dataParallelSize``
DATA_PARALLEL_ARGUMENTS = (
    "--data-parallel-size",
    "-dp",
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-rank",
    "-dpn",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-backend",
    "-dpb",
    "--data-parallel-hybrid-lb",
    "-dph",
    "--data-parallel-external-lb",
    "-dpe",
    "--data-parallel-multi-port-external-lb",
    "-dpm",
)
#: the port of vLLM's data-parallel coordination (its default, rendered so the pod says it)
DATA_PARALLEL_RPC_PORT = 29550
#: arguments kvbridge sets from the spec; ``extraArgs`` naming one of them is refused
MANAGED_ARGUMENTS = (
    "--port",
    "--tensor-parallel-size",
    "-tp",
    "--block-size",
    "--kv-transfer-config",
    "--kv-cache-dtype",
    "--dtype",
    "--model",
    "--attention-backend",
    "--nnodes",
    "-n",
    "--node-rank",
    "-r",
    "--master-addr",
    "--master-port",
    "--headless",
    "--shutdown-timeout",
    *DATA_PARALLEL_ARGUMENTS,
    "--enable-expert-parallel",
    "-ep",
)
#: the spec field each managed argument comes from (what to change instead)
MANAGED_BY_FIELD = {
    "--port": "the operator's HTTP port setting",
    "--tensor-parallel-size": "spec.<role>.tensorParallelSize",
    "-tp": "spec.<role>.tensorParallelSize",
    "--block-size": "spec.<role>.blockSize",
    "--kv-transfer-config": "spec.transfer",
    "--kv-cache-dtype": "spec.model.kvCacheDtype",
    "--dtype": "spec.model.kvCacheDtype",
    "--model": "spec.model.name",
    "--attention-backend": "spec.model.attention",
    "--shutdown-timeout": "spec.transfer.drainSeconds",
    **dict.fromkeys(
        ("--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port", "--headless"), "spec.<role>.nodes"
    ),
    **dict.fromkeys(DATA_PARALLEL_ARGUMENTS, "spec.<role>.dataParallelSize"),
    **dict.fromkeys(("--enable-expert-parallel", "-ep"), "spec.<role>.expertParallel"),
}
#: why pipeline parallelism is refused rather than modelled
PIPELINE_STAGES = (
    "splits the layers over pipeline stages, each stage a KV cache of its own layers that prefill and decode would "
    "have to pair stage by stage (use spec.<role>.tensorParallelSize and spec.<role>.dataParallelSize instead)"
)
#: arguments that change what the plan and the pod's resources assume, and that kvbridge does not model yet
UNMODELLED_ARGUMENTS = {
    "--pipeline-parallel-size": PIPELINE_STAGES,
    "-pp": PIPELINE_STAGES,
    "--decode-context-parallel-size": "shards the KV cache over context-parallel ranks",
    "-dcp": "shards the KV cache over context-parallel ranks",
    "--config": "reads further arguments from a file kvbridge cannot check",
}


def argument_name(arg: str) -> str:
    """An argument's name as vLLM's parser reads it: ``--tensor_parallel_size=16`` is ``--tensor-parallel-size``
    (argparse there accepts underscores and the ``=`` form; the later of two flags wins)."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


#: the port vLLM serves on behind the routing sidecar (the sidecar takes the pod's HTTP port)
VLLM_PORT_BEHIND_SIDECAR = 8200
HEALTH_PATH = "/health"  # vLLM's OpenAI server: 200 once the engine is up
#: CPU attention (vLLM's CPU_ATTN backend) runs blocks of a multiple of this many tokens
CPU_BLOCK_MULTIPLE = 32
#: host memory a CPU vLLM pod needs besides its KV cache (API server, engine core, one worker per rank)
CPU_BASE_MEMORY_GIB = 4


#: the ``sitecustomize`` the CPU launcher gives vLLM's processes (every process vLLM spawns loads it), for two faults
#: of vLLM 0.32's CPU build:
#:
#: - Its NIXL worker on CPU pins its model thread to the last core of each NUMA node of the *machine*
#:   (``CpuPlatform.discover_numa_topology`` reads /sys and ignores the container's cpuset), so every P/D engine on a
#:   node computes on one core while the cores it was given idle — or, under a kubelet's static cpuset, the call
#:   fails. This keeps every affinity change within the cores the container started with (an empty intersection
#:   keeps them all).
#: - On CPUs with AMX, its CPU attention runs its AMX kernel (a bfloat16 model, blocks of a multiple of 32) without
#:   asking Linux for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and Linux kills a
#:   process that uses tiles unasked with SIGILL. oneDNN asks on its first AMX matrix multiply, so an engine whose first
#:   forward pass multiplies enough tokens runs by luck; a decode engine's first pass is the one-token step after a
#:   remote prefill, and its worker died (exit code -4) at its first request. This asks at start-up (first, so
#:   nothing else here can skip it; an exec'd process loses the grant, which is why every process asks), only where
#:   the CPU and kernel offer AMX tiles (ARCH_GET_XCOMP_SUPP); a failed call (a seccomp profile, say) is printed.
CPU_SITE = """\
import os
if os.uname().machine == "x86_64":
    try:
        import ctypes

        _libc, _offered = ctypes.CDLL(None, use_errno=True), ctypes.c_uint64(0)
        # arch_prctl(ARCH_GET_XCOMP_SUPP): what the CPU and kernel offer; EINVAL: a kernel before 5.16, no AMX
        if _libc.syscall(158, 0x1021, ctypes.byref(_offered)) != 0:
            _failed = ctypes.get_errno() != 22
        else:  # XFEATURE_XTILEDATA (bit 18) offered: ask for it, arch_prctl(ARCH_REQ_XCOMP_PERM, 18)
            _failed = bool(_offered.value >> 18 & 1) and _libc.syscall(158, 0x1023, 18) != 0
        if _failed:
            import sys

            print(f"kvbridge: could not ask Linux for AMX tiles: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    except (ImportError, OSError, AttributeError):
        pass
_cpus = os.environ.get("KVBRIDGE_CONTAINER_CPUS", "")
if _cpus and hasattr(os, "sched_setaffinity"):
    _allowed = frozenset(int(c) for c in _cpus.split(","))
    _set_affinity = os.sched_setaffinity

    def _confined(pid, mask):
        _set_affinity(pid, (set(mask) & _allowed) or _allowed)

    os.sched_setaffinity = _confined
"""

#: a ``python3 -c`` launcher for CPU pods: bind each TP rank to its own share of the cores the container may use
#: (the kubelet's cpuset), keep vLLM's later affinity changes within them and ask for AMX tiles (``CPU_SITE``, on
#: PYTHONPATH), then exec ``vllm serve``. vLLM's "auto" binding gives every rank all cores of a NUMA node, which on
#: a small node makes TP ranks fight over the same cores.
CPU_BIND_LAUNCHER = f"""\
import os, sys, tempfile
tp = int(sys.argv[1])
cpus = sorted(os.sched_getaffinity(0))
if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    if len(cpus) < tp:
        sys.exit(f"kvbridge: {{len(cpus)}} CPU(s) available for tensor-parallel size {{tp}}: request at least {{tp}}")
    per = len(cpus) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cpus[r * per:(r + 1) * per])) for r in range(tp))
site = tempfile.mkdtemp(prefix="kvbridge-site-")
with open(os.path.join(site, "sitecustomize.py"), "w") as f:
    f.write({CPU_SITE!r})
os.environ["KVBRIDGE_CONTAINER_CPUS"] = ",".join(map(str, cpus))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def on_cpu(spec: DisaggregatedDeploymentSpec) -> bool:
    return spec.engine.device is EngineDevice.CPU


#: where kvbridge's connector has run, per device, as ``kvbridge plan`` states it (docs/vllm.md, "What was run for
#: real"): a short stable line, changed only when the evidence changes
KVBRIDGE_PROVEN = {
    EngineDevice.GPU: "vLLM's GPU KV cache layouts, TP mappings, block conversions, MLA and the host buffer proven "
    "with vLLM's own allocator on host memory (real NIXL on DRAM) and on NVIDIA H200 and H100 GPUs (NIXL on VRAM, the "
    "digest on the GPU); real vLLM on GPUs not yet run",
    EngineDevice.CPU: "run in real vLLM (the 0.32 CPU build, real NIXL on DRAM): decode's tokens equal a single "
    "engine's",
}


def kv_buffer_device(spec: DisaggregatedDeploymentSpec) -> KVBufferDevice:
    """vLLM's ``kv_buffer_device``: ``spec.transfer.network.kvBufferDevice``, else the engine's own memory."""
    chosen = spec.transfer.network.kv_buffer_device
    if chosen is not None:
        return chosen
    return KVBufferDevice.CPU if on_cpu(spec) else KVBufferDevice.CUDA


def advisories(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """What the engines will run other than the spec asks, where refusing would refuse the defaults: reported by
    ``kvbridge plan`` and in the status and events, never silently dropped; the spec still runs."""
    if spec.transfer.verification is Verification.SAMPLED and not uses_kvbridge(spec):
        return [
            Problem(
                VLLM_NIXL_UNVERIFIED_SAMPLED,
                "spec.transfer.verification",
                words.NIXL_UNVERIFIED_SAMPLED,
            )
        ]
    return []


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """What vLLM (its NixlConnector, its CPU attention) cannot run of a spec, beyond the compatibility rules;
    reported together with them (the conversions are looked at wherever the wire format is defined)."""
    found: list[Problem] = []
    if spec.transfer.verification is Verification.ALL and not uses_kvbridge(spec):
        found.append(
            Problem(
                VLLM_NIXL_UNVERIFIED,
                "spec.transfer.verification",
                words.NIXL_UNVERIFIED,
            )
        )
    if spec.router.sign_transfers and not uses_kvbridge(spec):
        found.append(
            Problem(
                VLLM_NIXL_UNSIGNED,
                "spec.router.signTransfers",
                words.NIXL_UNSIGNED,
            )
        )
    given = [("spec.engine.extraArgs", arg) for arg in spec.engine.extra_args]
    given += [(f"spec.{role.value}.extraArgs", arg) for role in Role for arg in spec.role(role).extra_args]
    for where, arg in given:
        name = argument_name(arg)
        if spec.model.source and name in SOURCE_ARGUMENTS:
            found.append(
                Problem(
                    VLLM_MANAGED_ARGUMENT,
                    where,
                    words.MANAGED_BY_SOURCE.format(flag=arg.split("=", 1)[0]),
                )
            )
        elif name == tracing.VLLM_FLAG and spec.tracing is not None:
            found.append(
                Problem(
                    VLLM_MANAGED_ARGUMENT,
                    where,
                    words.MANAGED.format(flag=arg.split("=", 1)[0], field="spec.tracing.endpoint"),
                )
            )
        elif name in MANAGED_ARGUMENTS:
            found.append(
                Problem(
                    VLLM_MANAGED_ARGUMENT,
                    where,
                    words.MANAGED.format(flag=arg.split("=", 1)[0], field=MANAGED_BY_FIELD[name]),
                )
            )
        elif name in UNMODELLED_ARGUMENTS:
            found.append(
                Problem(
                    VLLM_UNMODELLED_ARGUMENT,
                    where,
                    words.UNMODELLED.format(flag=arg.split("=", 1)[0], why=UNMODELLED_ARGUMENTS[name]),
                )
            )
    if not on_cpu(spec) and spec.model.is_mla:
        found += [
            Problem(
                VLLM_MLA_BLOCK_SIZE,
                f"spec.{role.value}.blockSize",
                words.MLA_BLOCK_SIZE.format(
                    backend=MLA_BACKEND,
                    size=MLA_BLOCK_SIZE,
                    role=role.value,
                    have=spec.role(role).block_size,
                    other=_other_block_size(spec, role, MLA_BLOCK_SIZE, follows=True),
                ),
            )
            for role in Role
            if spec.role(role).block_size != MLA_BLOCK_SIZE
        ]
    if on_cpu(spec):
        found += _cpu_problems(spec)
    prefill, decode = spec.prefill.settings(), spec.decode.settings()
    if wire_format_defined(spec.model, prefill, decode) and not uses_kvbridge(spec):  # kvbridge converts on both
        for step in wire_format(spec.model, prefill, decode).steps(Role.PREFILL):
            where = "blockSize" if step.kind is ConversionKind.SPLIT_BLOCKS else "kvLayout"
            found.append(
                Problem(
                    VLLM_PREFILL_CONVERSION,
                    f"spec.prefill.{where}",
                    words.PREFILL_CONVERSION.format(
                        kind=step.kind.value, source=step.source, target=step.target, where=where
                    ),
                )
            )
    return found


def _other_block_size(spec: DisaggregatedDeploymentSpec, role: Role, value: int, *, follows: bool) -> str:
    """`` and spec.<other role>.blockSize: <value>`` where the advice to set ``role``'s block size to ``value``
    needs the other role to follow: the rule wants both (``follows``), or the compatibility rules refuse the ratio
    this role's value alone would make; else nothing."""
    other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
    if spec.role(other).block_size == value:
        return ""
    alone = spec.model_copy(update={role.value: spec.role(role).model_copy(update={"block_size": value})})
    if not follows:
        follows = bool(
            check_pair(
                alone.model, alone.prefill.settings(), alone.decode.settings(), alone.transfer, suggestions=False
            )
        )
    return f" and spec.{other.value}.blockSize: {value}" if follows else ""


def _cpu_block_size(block_size: int) -> int:
    """The block size CPU attention runs nearest below ``block_size`` (itself when it is a multiple of 32)."""
    return max(CPU_BLOCK_MULTIPLE, block_size // CPU_BLOCK_MULTIPLE * CPU_BLOCK_MULTIPLE)


def _cpu_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """vLLM's CPU build: CPU attention's block sizes and layout, and NixlConnector's block-size conversion,
    which does not know CPU attention's block interior (docs/troubleshooting.md, VLLM_CPU_BLOCK_SIZE_RATIO)."""
    found: list[Problem] = []
    for role, role_spec in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode)):
        fits = _cpu_block_size(role_spec.block_size)
        if fits != role_spec.block_size:
            # NixlConnector on CPU needs equal block sizes (VLLM_CPU_BLOCK_SIZE_RATIO)
            both = _other_block_size(spec, role, fits, follows=not uses_kvbridge(spec))
            found.append(
                Problem(
                    VLLM_CPU_BLOCK_SIZE,
                    f"spec.{role.value}.blockSize",
                    words.CPU_BLOCK_SIZE.format(
                        multiple=CPU_BLOCK_MULTIPLE, have=role_spec.block_size, role=role.value, fits=fits, both=both
                    ),
                )
            )
        if role_spec.kv_layout is not KVLayout.HND:
            found.append(
                Problem(
                    VLLM_CPU_KV_LAYOUT,
                    f"spec.{role.value}.kvLayout",
                    words.CPU_KV_LAYOUT.format(have=role_spec.kv_layout.value, role=role.value),
                )
            )
    if uses_kvbridge(spec):
        for role, role_spec in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode)):
            if role_spec.tensor_parallel_size > spec.model.num_kv_heads and not spec.model.is_mla:
                found.append(
                    Problem(
                        VLLM_KVBRIDGE_REPLICATED_HEADS,
                        f"spec.{role.value}.tensorParallelSize",
                        words.KVBRIDGE_REPLICATED_HEADS.format(
                            tp=role_spec.tensor_parallel_size, heads=spec.model.num_kv_heads, role=role.value
                        ),
                    )
                )
    elif spec.prefill.block_size != spec.decode.block_size:
        # NixlConnector's re-layout does not know CPU attention's block interior (kvbridge's connector does).
        # the one block size both sides can run: prefill's, or the multiple of 32 its own problem suggests
        common = _cpu_block_size(spec.prefill.block_size)
        fix = f"spec.decode.blockSize: {common}" + (
            "" if common == spec.prefill.block_size else f" and spec.prefill.blockSize: {common}"
        )
        found.append(
            Problem(
                VLLM_CPU_BLOCK_SIZE_RATIO,
                "spec.decode.blockSize",
                words.CPU_BLOCK_SIZE_RATIO.format(
                    prefill=spec.prefill.block_size, decode=spec.decode.block_size, fix=fix
                ),
            )
        )
    if spec.transfer.network.kv_buffer_device is KVBufferDevice.CUDA:
        found.append(
            Problem(
                VLLM_KV_BUFFER_DEVICE,
                "spec.transfer.network.kvBufferDevice",
                words.KV_BUFFER_DEVICE,
            )
        )
    if spec.model.cache_kind is not CacheKind.SPLIT:
        found.append(
            Problem(
                VLLM_CPU_CACHE_KIND,
                "spec.model.cacheKind",
                words.CPU_CACHE_KIND.format(kind=spec.model.cache_kind.value),
            )
        )
    if spec.model.kv_cache_dtype.value.startswith("fp8"):
        found.append(
            Problem(
                VLLM_CPU_KV_CACHE_DTYPE,
                "spec.model.kvCacheDtype",
                words.CPU_KV_CACHE_DTYPE,
            )
        )
    return found


@dataclass(frozen=True)
class VLLMEngine:
    """One role's vLLM engine: the command, ``vllm serve`` arguments and environment, as a pod gets them."""

    args: list[str]
    env: dict[str, str]
    #: environment variables filled in by the downward API: name -> fieldPath
    downward: dict[str, str] = field(default_factory=dict)
    port: int = 8000
    kv_transfer_config: Obj = field(default_factory=dict)
    #: what runs ``vllm serve``: itself on GPUs, the core-binding launcher on CPUs
    launcher: list[str] = field(default_factory=list)

    @property
    def command(self) -> list[str]:
        """The container's whole command line (the pod's ``command`` + ``args``)."""
        return [*self.launcher, "vllm", "serve", *self.args]


#: where vLLM finds kvbridge's connector (``kv_connector_module_path``)
KVBRIDGE_CONNECTOR_MODULE = "kvbridge_agent.vllm_connector"


def uses_kvbridge(spec: DisaggregatedDeploymentSpec) -> bool:
    return spec.engine.connector is Connector.KVBRIDGE


def kv_transfer_config(spec: DisaggregatedDeploymentSpec, plan: TransferPlan, role: Role) -> Obj:
    """vLLM's ``KVTransferConfig`` for one role (vLLM 0.32): NixlConnector's, or kvbridge's connector, which reads
    everything else from kvbridge's environment contract."""
    if uses_kvbridge(spec):
        return {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": KVBRIDGE_CONNECTOR_MODULE,
            "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
            "kv_buffer_device": kv_buffer_device(spec).value,
        }
    extra: Obj = {"backends": list(spec.transfer.backends), "kv_lease_duration": spec.transfer.lease_seconds}
    config: Obj = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
        "kv_buffer_device": kv_buffer_device(spec).value,
        "kv_connector_extra_config": extra,
    }
    if role is Role.DECODE and any(s.kind is ConversionKind.PERMUTE for s in plan.wire.steps(Role.DECODE)):
        config["enable_permute_local_kv"] = True  # decode is NHD, the wire (prefill) HND: permute after reading
    return config


def kv_cache_layout(spec: DisaggregatedDeploymentSpec, role_spec: RoleSpec) -> str:
    """``VLLM_KV_CACHE_LAYOUT`` in vLLM 0.32's words (its ``KVCacheLayout`` member names)."""
    return rendered_order(role_spec.kv_layout, spec.model.cache_kind).value


def attention_backend(spec: DisaggregatedDeploymentSpec) -> str | None:
    """``--attention-backend``: the backend whose cache layout the spec describes (MLA on GPUs: FlashMLA)."""
    if on_cpu(spec):
        return "CPU_ATTN"
    if spec.model.is_mla:
        return MLA_BACKEND  # chosen, not left to vLLM: the block size the plan checked must be one it runs
    return "FLASHINFER" if spec.model.cache_kind is CacheKind.BLOCKS_FIRST else "FLASH_ATTN"


def behind_sidecar(role: Role, config: OperatorConfig) -> bool:
    """Whether this role's vLLM sits behind the routing sidecar (decode pods, when a sidecar image is set)."""
    return role is Role.DECODE and bool(config.routing_sidecar_image)


def engine(
    dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig, loaded: Weights
) -> VLLMEngine:
    """What ``vllm serve`` runs with (``loaded``: the model's weights, ``model_source.weights``)."""
    spec = dd.spec
    role_spec: RoleSpec = spec.role(role)
    port = VLLM_PORT_BEHIND_SIDECAR if behind_sidecar(role, config) else config.agent_http_port
    transfer_config = kv_transfer_config(spec, plan, role)
    backend = attention_backend(spec)
    args = [
        loaded.model,
        *loaded.args,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(role_spec.tensor_parallel_size),
        "--block-size",
        str(role_spec.block_size),
        *_dtype_args(spec.model.kv_cache_dtype),
        *(["--attention-backend", backend] if backend else []),
        "--kv-transfer-config",
        json.dumps(transfer_config, separators=(",", ":"), sort_keys=True),
        # a block that prefill re-lays for the wire no longer matches its prefix-cache hash
        *(["--no-enable-prefix-caching"] if role is Role.PREFILL and plan.wire.steps(Role.PREFILL) else []),
        # kvbridge's connector moves several KV cache groups (vLLM's hybrid allocator) on GPU layouts only; on the CPU
        # build the allocator stays off, as vLLM keeps it for connectors that cannot move groups
        *(["--disable-hybrid-kv-cache-manager"] if on_cpu(spec) and uses_kvbridge(spec) else []),
        # SIGTERM drains the requests the engine has (children/termination.py: the pod's whole sequence)
        "--shutdown-timeout",
        str(spec.transfer.drain_seconds),
        *parallel_args(role_spec),
        *tracing.vllm_args(spec),
        *spec.engine.extra_args,
        *role_spec.extra_args,
    ]
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.transfer.side_channel_port),
        "VLLM_KV_CACHE_LAYOUT": kv_cache_layout(spec, role_spec),
    }
    launcher: list[str] = []
    if on_cpu(spec):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.engine.cpu_kv_cache_gib)
        launcher = ["python3", "-c", CPU_BIND_LAUNCHER, str(role_spec.tensor_parallel_size)]
    return VLLMEngine(
        args=args,
        env=env,
        downward={"VLLM_NIXL_SIDE_CHANNEL_HOST": "status.podIP"},
        port=port,
        kv_transfer_config=transfer_config,
        launcher=launcher,
    )


def parallel_args(role_spec: RoleSpec) -> list[str]:
    """vLLM's data- and expert-parallel arguments of one role's engine (none for DP 1 without EP). The engine's one
    API server spreads requests over its DP ranks (vLLM's internal load balancing); the DP ranks run in its one pod
    and coordinate on localhost, or over ``nodes`` pods of a LeaderWorkerSet group, each running its share
    (``--data-parallel-size-local``) and coordinating at the leader's address (multinode.py adds a worker's
    ``--headless`` and start rank). Each rank's NIXL side channel is on base port + its rank."""
    args: list[str] = []
    dp = role_spec.data_parallel_size
    if dp > 1:
        address = "$(LWS_LEADER_ADDRESS)" if role_spec.nodes > 1 else "127.0.0.1"
        args += [
            "--data-parallel-size",
            str(dp),
            "--data-parallel-size-local",
            str(dp // role_spec.nodes),
            "--data-parallel-address",
            address,
            "--data-parallel-rpc-port",
            str(DATA_PARALLEL_RPC_PORT),
        ]
    if role_spec.expert_parallel:
        args.append("--enable-expert-parallel")
    return args


def image(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> str:
    return spec.engine.image or (config.vllm_cpu_image if on_cpu(spec) else config.vllm_image)


def resources(spec: DisaggregatedDeploymentSpec, role_spec: RoleSpec, config: OperatorConfig) -> Obj:
    """GPU pods: DP x TP GPUs (/ nodes for an engine spanning nodes) and room to load weights; CPU pods: one core per
    TP rank (requests = limits, so a static CPU manager can give the pod whole cores) and the KV cache space on top of
    the process memory."""
    tp = role_spec.tensor_parallel_size
    if on_cpu(spec):
        amount = {"cpu": str(tp), "memory": f"{spec.engine.cpu_kv_cache_gib + CPU_BASE_MEMORY_GIB * tp}Gi"}
        return {"requests": amount, "limits": dict(amount)}
    # every DP rank's TP ranks; an engine spanning nodes: each node's pod holds its share of the ranks
    gpus = str(role_spec.world_size // role_spec.nodes)
    return {
        "requests": {"cpu": "4", "memory": "32Gi", config.gpu_resource: gpus},
        "limits": {config.gpu_resource: gpus},
    }


def _dtype_args(dtype: KVCacheDtype) -> list[str]:
    """The KV cache element type: fp8 is a KV-cache setting, the 16/32-bit types follow the model dtype."""
    if dtype.value.startswith("fp8"):
        return ["--kv-cache-dtype", dtype.value]
    return ["--dtype", dtype.value, "--kv-cache-dtype", "auto"]


def pod_containers(
    dd: DisaggregatedDeployment,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    base_env: list[Obj],
    side_channels: list[Obj],
    keys_volume: Obj,
) -> tuple[list[Obj], list[Obj]]:
    """A vLLM pod's containers — ``vllm serve`` (and, on decode with the routing sidecar, the sidecar in front of it)
    — and its volumes. With NixlConnector no key Secret: its side channel has no CURVE, the NetworkPolicy is what
    limits who reaches it; kvbridge's connector gets the Secret (``keys_volume``), as the agent worker does."""
    loaded = weights(dd.spec.model)
    served = container(dd, role, plan, config, base_env, loaded)
    served["ports"].extend(side_channels)
    served["securityContext"] = {"allowPrivilegeEscalation": False}
    volumes: list[Obj] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}, *loaded.volumes]
    if uses_kvbridge(dd.spec):
        volumes.append(keys_volume)
        served["volumeMounts"].append(
            {"name": keys_volume["name"], "mountPath": config.keys_mount_path, "readOnly": True}
        )
    return ([routing_sidecar(config), served] if behind_sidecar(role, config) else [served]), volumes


def container(
    dd: DisaggregatedDeployment,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    base_env: list[Obj],
    loaded: Weights,
) -> Obj:
    """The ``engine`` container running ``vllm serve`` with its HTTP port (named ``http``, or ``vllm`` behind the
    routing sidecar), its GPUs or CPUs; further ports are the caller's."""
    vllm = engine(dd, role, plan, config, loaded)
    env = [*base_env, *({"name": k, "value": v} for k, v in vllm.env.items())]
    env += [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in vllm.downward.items()]
    env += loaded.env
    probe = {"httpGet": {"path": HEALTH_PATH, "port": vllm.port}}
    return {
        "name": "engine",
        "image": image(dd.spec, config),
        "command": [*vllm.launcher, "vllm", "serve"],
        "args": vllm.args,
        "env": env,
        "ports": [
            {"name": "vllm" if behind_sidecar(role, config) else "http", "containerPort": vllm.port, "protocol": "TCP"}
        ],
        # loading weights and compiling take minutes: the startup probe allows 30 min before liveness applies
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "resources": resources(dd.spec, dd.spec.role(role), config),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *loaded.mounts],  # dshm: NCCL, TP ranks' memory
    }


def routing_sidecar(config: OperatorConfig) -> Obj:
    """llm-d's routing sidecar in front of a decode vLLM: it takes the pod's HTTP port, asks the prefill pod
    named by the router (``x-prefiller-host-port``) to prefill, then forwards to vLLM behind it."""
    return {
        "name": "routing-sidecar",
        "image": config.routing_sidecar_image,
        "args": [
            f"--port={config.agent_http_port}",
            f"--vllm-port={VLLM_PORT_BEHIND_SIDECAR}",
            *config.routing_sidecar_args,
        ],
        "ports": [{"name": "http", "containerPort": config.agent_http_port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": config.agent_http_port}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
