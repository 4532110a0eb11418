"""What vLLM (its NixlConnector, its CPU attention, its parallel launch) cannot run of a spec, refused before
scheduling, and what it runs other than asked (advisories).

Each problem's words are :mod:`.vllm_messages`'; each ends with the fix, which the remedy search checks.
"""

from __future__ import annotations

from kvbridge_agent.core import CacheKind, KVLayout, Problem, Role, Verification
from kvbridge_agent.core.compat import check_pair
from kvbridge_agent.core.wire import ConversionKind, wire_format, wire_format_defined
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.api.transfer import KVBufferDevice
from kvbridge_operator.children import tracing
from kvbridge_operator.children.engines import vllm_messages as words
from kvbridge_operator.children.engines import vllm_models
from kvbridge_operator.children.engines.vllm_cpu import CPU_BLOCK_MULTIPLE, cpu_block_size, cpu_build
from kvbridge_operator.children.engines.vllm_serve import (
    MANAGED_ARGUMENTS,
    MANAGED_BY_FIELD,
    MLA_BACKEND,
    MLA_BLOCK_SIZE,
    UNMODELLED_ARGUMENTS,
    argument_name,
    uses_kvbridge,
)
from kvbridge_operator.children.model_source import SOURCE_ARGUMENTS

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
#: data parallelism on vLLM's CPU build, which kvbridge has not run it on
DATA_PARALLEL_ON_CPU = "DATA_PARALLEL_ON_CPU"


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
    found += _argument_problems(spec)
    found += vllm_models.problems(spec)
    if not cpu_build(spec) and spec.model.is_mla:
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
    if cpu_build(spec):
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


def _argument_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """``extraArgs`` that set what kvbridge sets (from the spec, the model source or the tracing) or what it does not
    model."""
    found: list[Problem] = []
    given = [("spec.engine.extraArgs", arg) for arg in spec.engine.extra_args]
    given += [(f"spec.{role.value}.extraArgs", arg) for role in Role for arg in spec.role(role).extra_args]
    for where, arg in given:
        name, flag = argument_name(arg), arg.split("=", 1)[0]
        if spec.model.source and name in SOURCE_ARGUMENTS:
            code, message = VLLM_MANAGED_ARGUMENT, words.MANAGED_BY_SOURCE.format(flag=flag)
        elif name == tracing.VLLM_FLAG and spec.tracing is not None:
            code, message = VLLM_MANAGED_ARGUMENT, words.MANAGED.format(flag=flag, field="spec.tracing.endpoint")
        elif name in MANAGED_ARGUMENTS:
            code, message = VLLM_MANAGED_ARGUMENT, words.MANAGED.format(flag=flag, field=MANAGED_BY_FIELD[name])
        elif name in UNMODELLED_ARGUMENTS:
            code = VLLM_UNMODELLED_ARGUMENT
            message = words.UNMODELLED.format(flag=flag, why=UNMODELLED_ARGUMENTS[name])
        else:
            continue
        found.append(Problem(code, where, message))
    return found


def refused_extra_args(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """The arguments of ``spec.engine.extraArgs`` that kvbridge sets or does not model (the fix search drops them)."""
    refused = {*MANAGED_ARGUMENTS, *UNMODELLED_ARGUMENTS}
    return [arg for arg in spec.engine.extra_args if argument_name(arg) in refused]


def parallelism_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Where vLLM cannot run a role's data parallelism: on its CPU build."""
    found: list[Problem] = []
    for role in Role:
        dp_field, dp = f"spec.{role.value}.dataParallelSize", spec.role(role).data_parallel_size
        if dp > 1 and cpu_build(spec):
            found.append(
                Problem(
                    DATA_PARALLEL_ON_CPU,
                    dp_field,
                    f"{role.value} asks for {dp} data-parallel ranks on vLLM's CPU build, which does not run them "
                    "for a mixture-of-experts model (its CPU communicator has no all_gatherv, which the experts' "
                    "dispatch needs: the first forward fails) and where kvbridge has not run them for a dense one "
                    f"(its core binding gives TP ranks their cores, not DP ranks): set {dp_field}: 1 and run more "
                    "replicas",
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


def _cpu_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """vLLM's CPU build: CPU attention's block sizes and layout, and NixlConnector's block-size conversion,
    which does not know CPU attention's block interior (docs/troubleshooting.md, VLLM_CPU_BLOCK_SIZE_RATIO)."""
    found: list[Problem] = []
    for role, role_spec in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode)):
        fits = cpu_block_size(role_spec.block_size)
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
        common = cpu_block_size(spec.prefill.block_size)
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
