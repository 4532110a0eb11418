"""A small async Kubernetes API client (aiohttp) for exactly the calls the operator makes.

Every call is recorded as (verb, resource) in :attr:`KubeClient.calls`, which
the chart's tests compare with the RBAC rules it grants.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from kvbridge_agent.core import KVBridgeError

from .backoff import Backoff

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"

Obj = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    api_version: str  # "v1" or "group/version"
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.split("/")[0] if "/" in self.api_version else ""

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


PODS = Resource("v1", "pods")
SERVICES = Resource("v1", "services")
SECRETS = Resource("v1", "secrets")
EVENTS = Resource("v1", "events")
STATEFUL_SETS = Resource("apps/v1", "statefulsets")
NETWORK_POLICIES = Resource("networking.k8s.io/v1", "networkpolicies")
DEPLOYMENTS = Resource("kvbridge.io/v1alpha1", "disaggregateddeployments")

BY_KIND = {
    ("v1", "Pod"): PODS,
    ("v1", "Service"): SERVICES,
    ("v1", "Secret"): SECRETS,
    ("v1", "Event"): EVENTS,
    ("apps/v1", "StatefulSet"): STATEFUL_SETS,
    ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICIES,
}


class ApiError(KVBridgeError):
    code = "KUBERNETES_API_ERROR"

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}", code="KUBERNETES_API_ERROR")
        self.status = status
        self.reason = reason


#: tries per API call for transient failures (5xx, 429, connection errors, timeouts); a create retried after a
#: 500 that did create answers 409, which the reconciler handles like any existing object
CALL_ATTEMPTS = 5
CALL_BACKOFF = Backoff(base=0.2, cap=2.0)


#: how the operator's own requests name themselves to the API server (its audit log, and the emulator's counts)
USER_AGENT = "kvbridge-operator"


class KubeClient:
    def __init__(
        self, server: str, *, token: str | None = None, token_path: Path | None = None, ca_path: str | None = None,
        insecure: bool = False, timeout: float = 30.0, user_agent: str = USER_AGENT,
    ) -> None:  # fmt: skip
        self.server = server.rstrip("/")
        self.user_agent = user_agent
        self._token = token
        self._token_path = token_path
        self._ssl: ssl.SSLContext | bool = False if insecure else ssl.create_default_context(cafile=ca_path)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self.calls: set[tuple[str, str]] = set()

    @classmethod
    def in_cluster(cls) -> KubeClient:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KVBridgeError("not running in a cluster and no API server configured "
                                "(set KVBRIDGE_OPERATOR_API_SERVER)", code="NO_API_SERVER")  # fmt: skip
        return cls(f"https://{host}:{port}", token_path=SERVICE_ACCOUNT / "token",
                   ca_path=str(SERVICE_ACCOUNT / "ca.crt"))  # fmt: skip

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        token = self._token
        if self._token_path is not None:
            token = self._token_path.read_text().strip()  # re-read: projected tokens rotate
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self, verb: str, method: str, resource: Resource, path: str, *, body: Any = None,
        content_type: str | None = None, params: dict[str, str] | None = None,
    ) -> Any:  # fmt: skip
        self.calls.add((verb, resource.plural if not path.endswith("/status") else f"{resource.plural}/status"))
        data = None if body is None else json.dumps(body)
        attempt = 0
        while True:
            try:
                return await self._send(method, path, data, content_type, params)
            except (ApiError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                transient = not isinstance(exc, ApiError) or exc.status >= 500 or exc.status == 429
                if not transient or attempt + 1 >= CALL_ATTEMPTS:
                    raise
                await asyncio.sleep(CALL_BACKOFF.delay(attempt))
                attempt += 1

    async def _send(
        self, method: str, path: str, data: str | None, content_type: str | None, params: dict[str, str] | None
    ) -> Any:
        """One HTTP request; :class:`ApiError` for an error status."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        async with self._session.request(
            method, self.server + path, data=data, params=params, ssl=self._ssl,
            headers=self._headers(content_type or ("application/json" if data else None)),
        ) as response:  # fmt: skip
            text = await response.text()
            if response.status >= 400:
                try:
                    payload = json.loads(text)
                except json.JSONDecodeError:
                    payload = {}
                raise ApiError(response.status, str(payload.get("reason", response.reason)),
                               str(payload.get("message", text[:300])))  # fmt: skip
            return json.loads(text) if text else {}

    async def get(self, resource: Resource, namespace: str, name: str) -> Obj | None:
        try:
            result: Obj = await self._request("get", "GET", resource, resource.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    async def list(self, resource: Resource, namespace: str | None, label_selector: str = "") -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self._request("list", "GET", resource, resource.path(namespace), params=params)
        items: list[Obj] = result.get("items", [])
        return items

    async def create(self, resource: Resource, namespace: str, body: Obj) -> Obj:
        result: Obj = await self._request("create", "POST", resource, resource.path(namespace), body=body)
        return result

    async def patch(self, resource: Resource, namespace: str, name: str, body: Obj,
                    subresource: str | None = None) -> Obj:  # fmt: skip
        path = resource.path(namespace, name, subresource)
        result: Obj = await self._request("patch", "PATCH", resource, path, body=body, content_type=MERGE_PATCH)
        return result

    async def delete(self, resource: Resource, namespace: str, name: str) -> None:
        try:
            await self._request("delete", "DELETE", resource, resource.path(namespace, name))
        except ApiError as exc:
            if exc.status != 404:
                raise
