"""How the worker fails a request rather than vLLM's step: the typed failure of whatever a request's work raised
(logged with its traceback when unforeseen), and the handshakes it refuses rather than queues."""

from __future__ import annotations

import logging

from kvbridge_agent.core.errors import INTERNAL_ERROR, failure_of

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler

#: handshakes in flight at once, a thread each: a side channel that never answers holds its thread for the handshake
#: timeout, and a handshake with another prefill engine never waits behind it; past this many a request that needs
#: one more fails at once (HANDSHAKE_BUSY)
MAX_HANDSHAKES = 8
HANDSHAKE_BUSY = "HANDSHAKE_BUSY"


def request_failure(exc: Exception, default_code: str, subject: str) -> tuple[str, str]:
    """The typed failure of the requests ``exc`` hit (:func:`~kvbridge_agent.core.errors.failure_of`); an unexpected
    one is logged with its traceback."""
    code, message = failure_of(exc, default_code)
    if code == INTERNAL_ERROR:
        log.error("kvbridge: %.80s: unexpected %s", subject, message, exc_info=exc)
    return code, message
