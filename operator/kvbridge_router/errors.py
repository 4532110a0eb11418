"""The router's errors: an HTTP status, a stable code (docs/troubleshooting.md) and a message, answered in OpenAI's
error shape — the router's own, or the engine's error object when an engine refused the request (refusals.py).

Whichever wrote it, no pod name is in the body: the pods an error is about go to the router's log and to the
answer's headers, :data:`REFUSED_BY` (who wrote the error: ``prefill`` or ``decode`` for an engine's own error
object, ``router`` for the router's), :data:`PODS` (the pods it is about, comma-separated) and :data:`ERROR_CODE`
(the router's stable code, also when the body holds the engine's own)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from kvbridge_router.refusals import ErrorObject
from kvbridge_router.response import Response, error_body

#: who wrote the error: ``prefill`` or ``decode`` (the engine's own error object, passed on) or ``router``
REFUSED_BY = "X-KVBridge-Refused-By"
#: the pods the error is about, comma-separated (the engine that refused; the pods tried, timed out or unreachable)
PODS = "X-KVBridge-Pods"
#: the router's stable code for the error (docs/troubleshooting.md)
ERROR_CODE = "X-KVBridge-Error-Code"
#: the role that writes an error the router answers itself
ROUTER = "router"
#: what a pod's name may hold in a header (a DNS label's characters; anything else, from a hand-written status file
#: say, is a ``?``: no line break can reach the answer's head)
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._-]")


class RouteError(Exception):
    """An error the client gets, with an HTTP status and a stable code."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        retry: bool = False,
        param: str | None = None,
        reprefill: bool = False,
        *,
        pods: Sequence[str] = (),
        engine: tuple[str, ErrorObject] | None = None,
    ) -> None:
        """``retry``: another pod may succeed (nothing reached the client); ``reprefill``: the failed decode pod
        had the request (it may have read the KV, and prefill freed it), so a retry prefills again. ``pods``: the pods
        the error is about (the log and a header, never the body); ``engine``: the role and error object of an engine
        that refused the request, answered as the body instead of the router's own."""
        super().__init__(message)
        self.status, self.code, self.message, self.retry, self.param = status, code, message, retry, param
        self.reprefill = reprefill
        self.pods = tuple(pods)
        self.engine = engine

    @property
    def refused_by(self) -> str:
        return self.engine[0] if self.engine is not None else ROUTER

    def logged(self) -> str:
        """The error as the router's log says it: the message and the pods."""
        pods = f" [{self.refused_by}: {', '.join(self.pods)}]" if self.pods else ""
        return f"{self.message}{pods}"

    def headers(self) -> dict[str, str]:
        headers = {ERROR_CODE: self.code, REFUSED_BY: self.refused_by}
        if self.pods:
            headers[PODS] = ",".join(_NOT_IN_NAMES.sub("?", pod)[:253] for pod in self.pods)
        return headers

    def response(self) -> Response:
        if self.engine is not None:
            body = json.dumps({"error": self.engine[1]}).encode()
        else:
            body = error_body(self.status, self.code, self.message, self.param)
        return Response(body, self.status, headers=self.headers())
