"""The key router replicas sign their reports to each other with (``spec.router.replicas`` of 2 or more).

- **The Secret** ``<name>-router-peers`` holds 32 random bytes as 64 hex characters under ``key``; created once
  (never patched), deleted with the deployment (owner reference), like the router's token (transfer_token.py), and
  apart from it: decode pods mount that token to check signed transfers, and must not be able to forge what a router
  replica tells the others (kvbridge_router/peers.py).
- **Mounted read-only** into the router's pods only (``kvbridge-router --peer-key-file``), beside the headless
  Service of the same name whose address is every router pod (objects/router.py).
"""

from __future__ import annotations

import base64
import secrets as random

from kvbridge_operator.api.names import LABEL_DEPLOYMENT, ROUTER_PEERS_VOLUME, router_peers_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, DisaggregatedDeploymentSpec
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference

KEY = "key"
KEY_DIR = "/var/run/kvbridge/router-peers"
KEY_FILE = f"{KEY_DIR}/{KEY}"
KEY_BYTES = 32


def peers(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether the router's replicas report to each other: two or more of them."""
    return spec.router.enabled and spec.router.replicas >= 2


def secret(dd: DisaggregatedDeployment, uid: str) -> Obj:
    """A fresh key's Secret; created once, never patched (rotation: delete it, then restart the routers)."""
    namespace = dd.metadata.namespace or "default"
    name = router_peers_name(dd.metadata.name)
    metadata = child_metadata(name, namespace, {LABEL_DEPLOYMENT: dd.metadata.name}, owner_reference(dd, uid))
    data = {KEY: base64.b64encode(random.token_hex(KEY_BYTES).encode()).decode()}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata, "data": data}


def volume(deployment: str) -> Obj:
    """The Secret as the router pods' volume (its file readable by the router's non-root user)."""
    return {"name": ROUTER_PEERS_VOLUME, "secret": {"secretName": router_peers_name(deployment), "defaultMode": 0o444}}


def mount() -> Obj:
    return {"name": ROUTER_PEERS_VOLUME, "mountPath": KEY_DIR, "readOnly": True}
