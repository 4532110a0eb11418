"""The side channel's CURVE key pair, as a Secret created once."""

from __future__ import annotations

import base64

from kvbridge_operator.api.names import (
    LABEL_DEPLOYMENT,
    secret_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.keys import curve_keypair
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference


def secret(dd: DisaggregatedDeployment, uid: str) -> Obj:
    """A fresh side-channel key pair; created once, never patched (rotation is an explicit action)."""
    public, private = curve_keypair()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(
            secret_name(dd.metadata.name),
            dd.metadata.namespace or "default",
            {LABEL_DEPLOYMENT: dd.metadata.name},
            owner_reference(dd, uid),
        ),
        "data": {"curve-public": base64.b64encode(public).decode(), "curve-secret": base64.b64encode(private).decode()},
    }
