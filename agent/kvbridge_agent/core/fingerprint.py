"""The fingerprint: a short stable hash of everything that must match on both sides."""

from __future__ import annotations

import hashlib
import json

from .model import PROTOCOL_VERSION, ModelGeometry


def fingerprint_fields(model: ModelGeometry, protocol_version: int = PROTOCOL_VERSION) -> dict[str, object]:
    """The must-match fields (docs/protocol.md §2), in CRD words; ``numExperts`` only for a mixture-of-experts
    model, so the fingerprints of dense models stay as they were."""
    fields: dict[str, object] = {
        "protocolVersion": protocol_version,
        "name": model.name,
        "numLayers": model.num_layers,
        "numKVHeads": model.num_kv_heads,
        "headDim": model.head_dim,
        "kvCacheDtype": model.kv_cache_dtype.value,
        "attention": model.attention.value,
        "cacheKind": model.cache_kind.value,
    }
    if model.is_moe:
        fields["numExperts"] = model.num_experts
    return fields


def fingerprint(model: ModelGeometry, protocol_version: int = PROTOCOL_VERSION) -> str:
    """Eight hex digits of SHA-256 over the canonical JSON of :func:`fingerprint_fields`."""
    canonical = json.dumps(fingerprint_fields(model, protocol_version), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]
