"""The pairing key: which prefill and decode pods a router may put together.

The fingerprint hashes the model alone, so pods of one deployment keep it
through a change of tensor-parallel size, block size or layout, although
such a change makes old and new pods of the two roles a different plan, or
no plan at all.  The pairing key hashes every input of the compatibility
verdict, so two pods with the same key were rendered from one checked plan.
"""

from __future__ import annotations

import hashlib
import json

from kvbridge_agent.core import RoleSettings
from kvbridge_agent.core.fingerprint import fingerprint_fields
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec

#: role settings added after the first pods ran: in the key only where set, so the keys of deployments without
#: them stay as they were
_KEYED_WHEN_SET = ("data_parallel_size", "expert_parallel")


def _role_fields(settings: RoleSettings) -> dict[str, object]:
    unset = {name for name in _KEYED_WHEN_SET if getattr(settings, name) == RoleSettings.model_fields[name].default}
    return settings.model_dump(mode="json", by_alias=True, exclude=unset)


def pairing_fields(spec: DisaggregatedDeploymentSpec) -> dict[str, object]:
    """What the verdict and the rendered transfer configuration depend on, in CRD words: the model (with the
    protocol version), both roles' settings (data and expert parallelism among them), the conversion policy, the
    NIXL backends, the engine kind and device.
    The model's source (with its revision) is in it when set: pods of two revisions hold different weights, so
    KV computed by one is wrong for the other however equal the geometry. Not in it: replicas, images,
    templates, extra arguments, lease and timeouts, the side-channel port, the router, the InferencePool."""
    found: dict[str, object] = {
        "model": fingerprint_fields(spec.model),
        "prefill": _role_fields(spec.prefill.settings()),
        "decode": _role_fields(spec.decode.settings()),
        "conversion": spec.transfer.conversion.value,
        "backends": list(spec.transfer.backends),
        "engine": {"kind": spec.engine.kind.value, "device": spec.engine.device.value},
    }
    if spec.model.source:  # absent when unset, so the keys of deployments without a source stay as they were
        found["source"] = spec.model.source
    return found


def pairing(spec: DisaggregatedDeploymentSpec) -> str:
    """Ten hex digits of SHA-256 over the canonical JSON of :func:`pairing_fields`."""
    canonical = json.dumps(pairing_fields(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]
