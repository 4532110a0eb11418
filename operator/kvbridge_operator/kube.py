"""The operator's Kubernetes API access: ``kubernetes_asyncio`` underneath, exactly the calls the operator makes on top.

``kubernetes_asyncio`` (the asyncio port of the official client, not the
blocking ``kubernetes`` package, because every Kopf handler here is async and
a blocking call would stall the event loop that serves all deployments) loads
the credentials -- in-cluster service account with token rotation, or a
kubeconfig with its contexts, client certificates and exec plugins -- and
carries the requests. On top, this module keeps the resources by name, the
retries of transient failures, server-side apply under kvbridge's own field
manager, and a record of every (verb, resource) in :attr:`KubeClient.calls`,
which the chart's tests compare with the RBAC rules it grants.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.rest import ApiException

from kvbridge_agent.core import KVBridgeError
from kvbridge_operator.api.objects import Obj

from .backoff import Backoff

MERGE_PATCH = "application/merge-patch+json"


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
CONFIG_MAPS = Resource("v1", "configmaps")  # spec.autoscaling.profile
EVENTS = Resource("v1", "events")
STATEFUL_SETS = Resource("apps/v1", "statefulsets")
NETWORK_POLICIES = Resource("networking.k8s.io/v1", "networkpolicies")
POD_DISRUPTION_BUDGETS = Resource("policy/v1", "poddisruptionbudgets")
DEPLOYMENTS = Resource("kvbridge.io/v1alpha1", "disaggregateddeployments")
ROLES = Resource("kvbridge.io/v1alpha1", "disaggregatedroles")
# the serving path (spec.router, spec.inferencePool)
WORKLOADS = Resource("apps/v1", "deployments")
SERVICE_ACCOUNTS = Resource("v1", "serviceaccounts")
RBAC_ROLES = Resource("rbac.authorization.k8s.io/v1", "roles")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io/v1", "rolebindings")
INFERENCE_POOLS = Resource("inference.networking.k8s.io/v1", "inferencepools")
HTTP_ROUTES = Resource("gateway.networking.k8s.io/v1", "httproutes")
POD_GROUPS = Resource("scheduling.x-k8s.io/v1alpha1", "podgroups")  # spec.placement.gang
LEADER_WORKER_SETS = Resource("leaderworkerset.x-k8s.io/v1", "leaderworkersets")  # spec.<role>.nodes above 1

BY_KIND = {
    ("v1", "Pod"): PODS,
    ("v1", "Service"): SERVICES,
    ("v1", "Secret"): SECRETS,
    ("v1", "Event"): EVENTS,
    ("apps/v1", "StatefulSet"): STATEFUL_SETS,
    ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICIES,
    ("policy/v1", "PodDisruptionBudget"): POD_DISRUPTION_BUDGETS,
    ("kvbridge.io/v1alpha1", "DisaggregatedRole"): ROLES,
    ("apps/v1", "Deployment"): WORKLOADS,
    ("v1", "ServiceAccount"): SERVICE_ACCOUNTS,
    ("rbac.authorization.k8s.io/v1", "Role"): RBAC_ROLES,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ROLE_BINDINGS,
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOLS,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTES,
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): POD_GROUPS,
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): LEADER_WORKER_SETS,
}


def resource_of(kind: str) -> Resource:
    """The resource of a kind kvbridge writes (kinds are unique among them)."""
    return next(resource for (_, k), resource in BY_KIND.items() if k == kind)


class ApiError(KVBridgeError):
    code = "KUBERNETES_API_ERROR"

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}", code="KUBERNETES_API_ERROR")
        self.status = status
        self.reason = reason

    @classmethod
    def from_exception(cls, exc: ApiException) -> ApiError:
        """The API's Status object (reason, message) when it sent one, else the HTTP reason and the body."""
        text = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            payload = {}
        payload = payload if isinstance(payload, dict) else {}
        return cls(
            int(exc.status or 0), str(payload.get("reason") or exc.reason), str(payload.get("message") or text[:300])
        )


#: tries per API call for transient failures (5xx, 429, connection errors, timeouts); a create retried after a
#: 500 that did create answers 409, which the reconciler handles like any existing object
CALL_ATTEMPTS = 5
CALL_BACKOFF = Backoff(base=0.2, cap=2.0)


#: how the operator's own requests name themselves to the API server (its audit log, and the emulator's counts)
USER_AGENT = "kvbridge-operator"
#: the field manager of every server-side apply: the fields kvbridge sets are kvbridge's; fields others own (an
#: autoscaler's replicas, a user's annotations) are left alone
FIELD_MANAGER = "kvbridge-operator"
APPLY_PATCH = "application/apply-patch+yaml"
_RESULT = {200: "object", 201: "object", 202: "object"}
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


@dataclass(frozen=True)
class Connection:
    """Where the operator's API access comes from, resolved as kubectl and controller-runtime resolve it."""

    configuration: k8s.Configuration
    source: str  # for the log: "in-cluster", "kubeconfig /path (context x)", "http://127.0.0.1:1234"

    @property
    def token(self) -> str | None:
        value = self.configuration.api_key.get("BearerToken")
        return str(value).removeprefix("Bearer ").strip() if value else None


def _url_configuration(server: str, token: str | None = None) -> k8s.Configuration:
    configuration = k8s.Configuration(host=server.rstrip("/"))
    configuration.verify_ssl = False  # a URL is for local emulators and tests; clusters come through kubeconfig
    if token:
        configuration.api_key["BearerToken"] = f"Bearer {token}"
    return configuration


async def connect(
    api_server: str = "", kubeconfig: str = "", context: str = "", environ: dict[str, str] | None = None
) -> Connection:
    """The API server and credentials: ``api_server`` (a URL, for local emulators); else a kubeconfig named by
    ``--kubeconfig`` or ``KUBECONFIG``; else the in-cluster service account; else ``~/.kube/config``. A
    ``context`` picks one of the kubeconfig's contexts (and asks for a kubeconfig even in a pod)."""
    env = dict(os.environ if environ is None else environ)
    if api_server:
        return Connection(_url_configuration(api_server), api_server)
    path = kubeconfig or env.get("KUBECONFIG", "")
    in_cluster = bool(env.get("KUBERNETES_SERVICE_HOST")) and not path and not context
    if in_cluster:
        configuration = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException as exc:
            raise KVBridgeError(f"in-cluster configuration: {exc}", code="NO_API_SERVER") from exc
        return Connection(configuration, "in-cluster service account")
    path = path or str(Path(env.get("HOME", "~")).expanduser() / ".kube" / "config")
    if not any(Path(p).expanduser().is_file() for p in path.split(os.pathsep) if p):
        raise KVBridgeError(
            f"no Kubernetes API to talk to: not in a pod, and no kubeconfig at {path} (give --kubeconfig, set "
            "KUBECONFIG, or --api-server for a local emulator)",
            code="NO_API_SERVER",
        )
    configuration = k8s.Configuration()
    try:
        await k8s_config.load_kube_config(
            config_file=path, context=context or None, client_configuration=configuration, persist_config=False
        )
    except (k8s_config.ConfigException, OSError, ValueError) as exc:
        raise KVBridgeError(f"kubeconfig {path}: {exc}", code="BAD_KUBECONFIG") from exc
    return Connection(configuration, f"kubeconfig {path}" + (f" (context {context})" if context else ""))


class KubeClient:
    def __init__(self, connection: Connection, *, timeout: float = 30.0, user_agent: str = USER_AGENT) -> None:
        self.connection = connection
        self.server = str(connection.configuration.host)
        self.user_agent = user_agent
        self._timeout = timeout
        self._api: k8s.ApiClient | None = None
        self.calls: set[tuple[str, str]] = set()

    @classmethod
    def for_url(cls, server: str, *, token: str | None = None, user_agent: str = USER_AGENT) -> KubeClient:
        """A client of a local API (an emulator): plain HTTP or unverified TLS, an optional bearer token."""
        return cls(Connection(_url_configuration(server, token), server), user_agent=user_agent)

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _request(
        self,
        verb: str,
        method: str,
        resource: Resource,
        path: str,
        *,
        body: Any = None,
        content_type: str | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        self.calls.add((verb, resource.plural if not path.endswith("/status") else f"{resource.plural}/status"))
        attempt = 0
        while True:
            try:
                return await self._send(method, path, body, content_type, params)
            except (ApiError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                transient = not isinstance(exc, ApiError) or exc.status >= 500 or exc.status == 429
                if not transient or attempt + 1 >= CALL_ATTEMPTS:
                    raise
                await asyncio.sleep(CALL_BACKOFF.delay(attempt))
                attempt += 1

    def _client(self) -> k8s.ApiClient:
        if self._api is None:
            self._api = k8s.ApiClient(self.connection.configuration)
            self._api.user_agent = self.user_agent
            session = self._api.rest_client.pool_manager
            if not any(os.environ.get(v) for v in PROXY_VARIABLES) and hasattr(session, "_trust_env"):
                # kubernetes_asyncio's session trusts the environment, so aiohttp looks for proxies and ~/.netrc on
                # every request (measured: 1.4 ms of CPU per request, three times the request itself); with no
                # proxy configured there is nothing to find
                session._trust_env = False
        return self._api

    async def _send(
        self, method: str, path: str, body: Any, content_type: str | None, params: dict[str, str] | None
    ) -> Any:
        """One HTTP request through kubernetes_asyncio; :class:`ApiError` for an error status."""
        api = self._client()
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        try:
            return await api.call_api(
                path,
                method,
                query_params=list((params or {}).items()),
                header_params=headers,
                body=body,
                response_types_map=_RESULT,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            raise ApiError.from_exception(exc) from None

    async def get(self, resource: Resource, namespace: str, name: str, subresource: str | None = None) -> Obj | None:
        try:
            path = resource.path(namespace, name, subresource)
            result: Obj = await self._request("get", "GET", resource, path)
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

    async def patch(
        self, resource: Resource, namespace: str, name: str, body: Obj, subresource: str | None = None
    ) -> Obj:
        path = resource.path(namespace, name, subresource)
        result: Obj = await self._request("patch", "PATCH", resource, path, body=body, content_type=MERGE_PATCH)
        return result

    async def apply(self, resource: Resource, obj: Obj, *, field_manager: str = FIELD_MANAGER) -> Obj:
        """Server-side apply: create ``obj`` or make its fields, and only those, what it says; fields this manager
        set before and left out now are removed unless another manager owns them too. ``force`` takes over a
        field another manager set to a different value, so ``obj`` must hold only what kvbridge decides."""
        meta = obj["metadata"]
        path = resource.path(meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true"}
        result: Obj = await self._request(
            "patch", "PATCH", resource, path, body=obj, content_type=APPLY_PATCH, params=params
        )
        return result

    async def watch(
        self, resource: Resource, namespace: str, field_selector: str, resource_version: str, timeout_seconds: int
    ) -> AsyncIterator[Obj]:
        """One watch request: its events (``{"type", "object"}``) until the server ends it after
        ``timeout_seconds``; raises :class:`ApiError` for an error status (410: the version is gone, list again)."""
        params = {
            "watch": "true",
            "fieldSelector": field_selector,
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            "allowWatchBookmarks": "true",
        }
        self.calls.add(("watch", resource.plural))
        try:
            response = await self._client().call_api(
                resource.path(namespace),
                "GET",
                query_params=list(params.items()),
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=False,
                _request_timeout=timeout_seconds + 30,
            )
        except ApiException as exc:
            raise ApiError.from_exception(exc) from None
        async with response:
            async for line in response.content:
                if line.strip():
                    event: Obj = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise ApiError(
                            int(status.get("code", 500)), str(status.get("reason", "")), str(status.get("message", ""))
                        )
                    yield event

    async def delete(self, resource: Resource, namespace: str, name: str) -> None:
        try:
            await self._request("delete", "DELETE", resource, resource.path(namespace, name))
        except ApiError as exc:
            if exc.status != 404:
                raise
