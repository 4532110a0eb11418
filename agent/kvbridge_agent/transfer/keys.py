"""CURVE keys of the side channel: one key pair per DisaggregatedDeployment.

The operator mounts the pair from a Secret as two files, ``curve-public`` and
``curve-secret`` (Z85 text). Every pod of the deployment holds the pair: the
prefill listener uses it as its server key and admits only clients that
prove they hold the same pair, so a peer without the Secret gets no metadata.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvbridge_agent.core import KVBridgeError

PUBLIC_FILE = "curve-public"
SECRET_FILE = "curve-secret"
KEYS_INVALID = "KEYS_INVALID"


class KeysError(KVBridgeError):
    code = KEYS_INVALID


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes


def generate_keys(directory: str | Path) -> CurveKeys:
    """Write a fresh key pair to ``directory`` (secret readable by the owner only)."""
    if not zmq.has("curve"):
        raise KeysError("this libzmq has no CURVE support", code=KEYS_INVALID)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    (path / PUBLIC_FILE).write_bytes(public + b"\n")
    secret_path = path / SECRET_FILE
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret + b"\n")
    return CurveKeys(public, secret)


def load_keys(directory: str | Path) -> CurveKeys:
    """Read the key pair; a typed error names the file that is missing or malformed."""
    path = Path(directory)
    values = []
    for name in (PUBLIC_FILE, SECRET_FILE):
        try:
            value = (path / name).read_bytes().strip()
        except OSError as exc:
            raise KeysError(f"cannot read {path / name}: {exc.strerror}", field=str(path / name)) from exc
        if len(value) != 40:
            raise KeysError(
                f"{path / name} must hold a 40-character Z85 key, found {len(value)} bytes", field=str(path / name)
            )
        values.append(value)
    try:
        derived = zmq.curve_public(values[1])
    except (zmq.ZMQError, ValueError) as exc:
        raise KeysError(f"{path / SECRET_FILE} is not a Z85 CURVE key: {exc}", field=str(path / SECRET_FILE)) from exc
    if derived != values[0]:
        raise KeysError(f"{path / PUBLIC_FILE} does not belong to {path / SECRET_FILE}", field=str(path / PUBLIC_FILE))
    return CurveKeys(values[0], values[1])
