"""Side-channel CURVE key pairs for the Secret, without ZeroMQ in the operator image.

ZeroMQ CURVE keys are X25519 keys in Z85 text (ZeroMQ RFC 32); the agent
reads them with pyzmq.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

_Z85 = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def z85_encode(data: bytes) -> bytes:
    if len(data) % 4:
        raise ValueError("Z85 encodes multiples of 4 bytes")
    out = bytearray()
    for offset in range(0, len(data), 4):
        value = int.from_bytes(data[offset : offset + 4], "big")
        chunk = bytearray()
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(_Z85[digit])
        out += chunk[::-1]
    return bytes(out)


def curve_keypair() -> tuple[bytes, bytes]:
    """A fresh (public, secret) pair as 40-character Z85 keys."""
    private = X25519PrivateKey.generate()
    secret = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return z85_encode(public), z85_encode(secret)
