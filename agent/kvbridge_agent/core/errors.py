"""Typed errors and problems.

Every failure that a user or an engine can cause carries a stable ``code``,
the ``field`` at fault (a CRD path such as ``spec.decode.tensorParallelSize``
or a request attribute such as ``request.local_block_ids``) and a message
that says what would work.  Codes are part of the public interface: they
appear in ``kvbridge plan`` output, in status conditions and in
``docs/troubleshooting.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason why a prefill/decode pair cannot exchange KV caches."""

    code: str
    field: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "field": self.field, "message": self.message}


class KVBridgeError(Exception):
    """Base of every kvbridge error: a stable code, the field at fault, a message."""

    code: str = "KVBRIDGE_ERROR"

    def __init__(self, message: str, *, field: str = "", code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.field = field
        self.message = message

    def __str__(self) -> str:
        where = f" ({self.field})" if self.field else ""
        return f"{self.code}{where}: {self.message}"


class SpecError(KVBridgeError):
    """A value is malformed or out of range on its own (not a P/D mismatch)."""

    code = "INVALID_SPEC"


class IncompatibleError(KVBridgeError):
    """Prefill and decode settings cannot exchange KV caches; ``problems`` says why."""

    code = "INCOMPATIBLE"

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        summary = "; ".join(f"{p.code} at {p.field}: {p.message}" for p in self.problems)
        first = self.problems[0] if self.problems else Problem("INCOMPATIBLE", "", "")
        super().__init__(summary or "incompatible", field=first.field, code="INCOMPATIBLE")


class BlockMappingError(KVBridgeError):
    """A request's block ids cannot be mapped onto the plan (one request fails, not the engine)."""

    code = "BLOCK_MAPPING"


#: an unexpected exception, turned into a failure of the requests it hit (the engine serves on)
INTERNAL_ERROR = "INTERNAL_ERROR"


def failure_of(exc: BaseException, default_code: str) -> tuple[str, str]:
    """The typed failure of the requests an exception hit: kvbridge's own code and message; an ``OSError``'s text
    under ``default_code``; anything else (a ``MemoryError``, a bug) :data:`INTERNAL_ERROR` with its type, so that
    no input a request or a peer brings escapes as an exception into the engine that runs kvbridge."""
    if isinstance(exc, KVBridgeError):
        return exc.code, exc.message
    if isinstance(exc, OSError):
        return default_code, str(exc)
    return INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"[:500]
