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
from kvbridge_operator.children.engines import engine_of

#: role settings added after the first pods ran: in the key only where set, so the keys of deployments without
#: them stay as they were
_KEYED_WHEN_SET = ("data_parallel_size", "expert_parallel")


def _role_fields(settings: RoleSettings) -> dict[str, object]:
    unset = {name for name in _KEYED_WHEN_SET if getattr(settings, name) == RoleSettings.model_fields[name].default}
    return settings.model_dump(mode="json", by_alias=True, exclude=unset)


#: the model's layer description (spec.model.layerTypes and what defines its kinds): in the key, not the fingerprint
#: (the engines are not told it: vLLM reads the layers from the weights' config, which the name and source pin), and
#: only where set, so the keys of deployments without it stay as they were
_LAYER_FIELDS = ("layer_types", "sliding_window", "attention_chunk_size", "state_space")


def _model_fields(spec: DisaggregatedDeploymentSpec) -> dict[str, object]:
    model = spec.model
    unset = {
        name
        for name in _LAYER_FIELDS
        if getattr(model, name) == type(model).model_fields[name].get_default(call_default_factory=True)
    }
    layers = model.model_dump(mode="json", by_alias=True, include=set(_LAYER_FIELDS) - unset)
    return {**fingerprint_fields(model), **layers}


def pairing_fields(spec: DisaggregatedDeploymentSpec) -> dict[str, object]:
    """What the verdict and the rendered transfer configuration depend on, in CRD words: the model (with the
    protocol version; its layer description where set), both roles' settings (data and expert parallelism among
    them), the conversion policy, the NIXL backends, the engine kind (its ``pairing_name``: the synthetic engine is
    keyed as ``Agent``, its name when its first pods ran) and device.
    The model's source (with its revision) is in it when set: pods of two revisions hold different weights, so
    KV computed by one is wrong for the other however equal the geometry. Not in it: replicas, images,
    templates, extra arguments, lease and timeouts, the side-channel port, the router, the InferencePool."""
    found: dict[str, object] = {
        "model": _model_fields(spec),
        "prefill": _role_fields(spec.prefill.settings()),
        "decode": _role_fields(spec.decode.settings()),
        "conversion": spec.transfer.conversion.value,
        "backends": list(spec.transfer.backends),
        "engine": {"kind": engine_of(spec).pairing_name, "device": spec.engine.device.value},
    }
    if spec.model.source:  # absent when unset, so the keys of deployments without a source stay as they were
        found["source"] = spec.model.source
    return found


def pairing(spec: DisaggregatedDeploymentSpec) -> str:
    """Ten hex digits of SHA-256 over the canonical JSON of :func:`pairing_fields`."""
    canonical = json.dumps(pairing_fields(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]
