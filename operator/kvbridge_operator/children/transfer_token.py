"""The router's token (``spec.router.signTransfers``): decode engines accept ``kv_transfer_params`` only as
kvbridge's router signs them.

- **The Secret** ``<name>-router-token`` holds 32 random bytes as 64 hex characters under ``token``; it is created
  once (never patched: rotation is an explicit action, as for the side channel's keys) and deleted with the
  deployment (owner reference). objects/router.py renders it with the router's children.
- **Mounted read-only** into the router's pods (``kvbridge-router --transfer-token-file``) and the decode engines'
  (``KVBRIDGE_TRANSFER_TOKEN_FILE``: the synthetic engine and kvbridge's vLLM connector check the signature,
  ``kvbridge_agent.core.signing``); prefill pods do not get it.
- **Checked:** ``signTransfers`` needs ``router.enabled`` (spec.py, CEL) and an engine that checks the signature:
  vLLM's NixlConnector does not (engines/vllm_problems.py, ``VLLM_NIXL_UNSIGNED``).
"""

from __future__ import annotations

import base64
import secrets

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import ENGINE_CONTAINER, ROUTER_TOKEN_VOLUME, router_token_secret_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec

#: the Secret's key, and where pods mount the Secret
TOKEN_KEY = "token"
TOKEN_DIR = "/var/run/kvbridge/router-token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
#: random bytes of a fresh token
TOKEN_BYTES = 32


def signs(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether the router signs decode's transfer parameters and the decode engines check them."""
    return spec.router.enabled and spec.router.sign_transfers


def token_file(spec: DisaggregatedDeploymentSpec, role: Role) -> str | None:
    """``KVBRIDGE_TRANSFER_TOKEN_FILE`` of a role's engines: the mounted token on decode when signing, else none."""
    return TOKEN_FILE if signs(spec) and role is Role.DECODE else None


def secret_data() -> dict[str, str]:
    """A fresh token, as a Secret's ``data``."""
    return {TOKEN_KEY: base64.b64encode(secrets.token_hex(TOKEN_BYTES).encode()).decode()}


def volume(deployment: str, mode: int = 0o400) -> Obj:
    """The Secret as a pod volume; ``mode``: the file's (the engines', like the side channel's keys: the owner's
    only; the router runs as a non-root user the Secret's root-owned file must be readable by)."""
    secret = {"secretName": router_token_secret_name(deployment), "defaultMode": mode}
    return {"name": ROUTER_TOKEN_VOLUME, "secret": secret}


def mount() -> Obj:
    return {"name": ROUTER_TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}


def apply(template: Obj, spec: DisaggregatedDeploymentSpec, deployment: str, role: Role) -> Obj:
    """``template`` (changed in place and returned) with the token mounted into the engine container, on decode
    pods when signing; else unchanged."""
    if token_file(spec, role) is None:
        return template
    template["spec"].setdefault("volumes", []).append(volume(deployment))
    for container in template["spec"]["containers"]:
        if container.get("name") == ENGINE_CONTAINER:
            container.setdefault("volumeMounts", []).append(mount())
    return template
