"""The router's errors: an HTTP status, a stable code (docs/troubleshooting.md) and a message, answered in OpenAI's
error shape."""

from __future__ import annotations

from kvbridge_router.response import Response, error_body


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
    ) -> None:
        """``retry``: another pod may succeed (nothing reached the client); ``reprefill``: the failed decode pod
        had the request (it may have read the KV and prefill freed it), so a retry prefills again."""
        super().__init__(message)
        self.status, self.code, self.message, self.retry, self.param = status, code, message, retry, param
        self.reprefill = reprefill

    def response(self) -> Response:
        return Response(error_body(self.status, self.code, self.message, self.param), self.status)
