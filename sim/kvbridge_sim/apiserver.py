"""A realistic enough Kubernetes API for Kopf and the operator: kmock's emulator plus what they rely on.

kmock 0.8's ``KubernetesEmulator`` keeps objects as plain merged dicts. This
subclass adds (docs/development.md): ``uid``,
``creationTimestamp``, ``generation`` bumped on spec changes only, a fresh
``resourceVersion`` on every write, ``generateName``, merge and JSON patches
(a failed JSON-patch ``test`` answers 422), server-side apply with field managers and
``metadata.managedFields`` (field_managers), status and scale subresources, watches that
subscribe before the snapshot and honour ``resourceVersion`` and
``timeoutSeconds``, typed lists, ``/api/v1`` discovery, label and field
selectors, cluster-scoped namespaces and CRDs that register their resource; and what the
real ``kubectl`` needs: discovery as Kubernetes lists it, OpenAPI v3 (openapi), server-side
Tables (tables), 404s worded as Kubernetes words them.

Like kmock, it does no garbage collection; it validates custom resources only for unknown
fields (``fieldValidation``): tests check ownerReferences and validate objects separately.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import itertools
import secrets
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import k8s as kmock_k8s
from kmock._internal import rendering

from kvbridge_operator.api.objects import Obj, now_rfc3339
from kvbridge_sim import field_managers, kinds, openapi, pod_logs, tables, watches
from kvbridge_sim.selectors import field_match, label_match, merge_patch

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name

APPLY_PATCH = "application/apply-patch+yaml"
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


@attrs.define(kw_only=True)
class RealisticKubernetes(kmock.KubernetesEmulator):
    store: dict[Key, Obj] = attrs.field(factory=dict, init=False)
    kinds: dict[tuple[str, str, str], dict[str, Any]] = attrs.field(factory=dict, init=False)
    history: collections.deque[tuple[int, tuple[str, str, str], Obj]] = attrs.field(
        factory=lambda: collections.deque(maxlen=50_000), init=False
    )
    watchers: list[tuple[tuple[str, str, str], asyncio.Queue[tuple[int, Obj]]]] = attrs.field(factory=list, init=False)
    counter: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    revision: int = attrs.field(default=0, init=False)
    #: fault injection for tests and benchmarks: called with the verb, the plural and the request headers of every
    #: resource request; returns ``(status, delay_seconds)`` to delay it and, for a status >= 400, fail it, or
    #: ``None`` to serve it
    faults: Callable[[str, str, Mapping[str, str]], tuple[int, float] | None] | None = attrs.field(
        default=None, init=False
    )

    #: where the local kubelet keeps pods' container logs (``kubectl logs``; pod_logs.py), once one runs pods
    pod_logs: pod_logs.LogSource | None = attrs.field(default=None, init=False)

    #: every resource request served, by (the client's User-Agent up to its first "/", verb, plural)
    calls: collections.Counter[tuple[str, str, str]] = attrs.field(factory=collections.Counter, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for (group, version, plural), info in kinds.BUILTIN.items():
            self.declare(group, version, plural, **info)

    # -- resources ------------------------------------------------------------
    def declare(
        self,
        group: str,
        version: str,
        plural: str,
        *,
        kind: str,
        namespaced: bool,
        subresources: set[str] | None = None,
        shortnames: set[str] | None = None,
        singular: str | None = None,
        scale: dict[str, str] | None = None,
        schema: Obj | None = None,
        columns: list[Obj] | None = None,
    ) -> None:
        self.kinds[(group, version, plural)] = {
            "kind": kind,
            "namespaced": namespaced,
            "subresources": set(subresources or ()),
            "scale": scale,
            "schema": schema,
            "columns": columns,
            "singular": singular or kind.lower(),
            "shortnames": sorted(shortnames or ()),
        }
        self.resources[kmock.resource(group, version, plural)] = kmock.ResourceInfo(
            kind=kind,
            namespaced=namespaced,
            verbs=VERBS,
            subresources=subresources or set(),
            shortnames=shortnames or set(),
            singular=singular or kind.lower(),
        )

    def _install_crd(self, crd: Obj) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            self.declare(
                spec["group"],
                version["name"],
                names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope") == "Namespaced",
                subresources=set(version.get("subresources") or {}),
                scale=(version.get("subresources") or {}).get("scale"),
                shortnames=set(names.get("shortNames") or ()),
                singular=names.get("singular"),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                columns=version.get("additionalPrinterColumns"),
            )

    @staticmethod
    def _gvp(request: rendering.Request) -> tuple[str, str, str]:
        resource = request.resource
        if resource is None:  # pragma: no cover - only k8s requests get here
            raise kmock.KubernetesError(status=404, reason="NotFound", message="not a resource")
        return (resource.group or "", resource.version or "", resource.plural or "")

    def _info(self, request: rendering.Request) -> dict[str, Any]:
        info = self.kinds.get(self._gvp(request))
        if info is None:
            raise kmock_k8s.KubernetesResourceNotFoundError()
        return info

    def _api_version(self, gvp: tuple[str, str, str]) -> str:
        return gvp[1] if not gvp[0] else f"{gvp[0]}/{gvp[1]}"

    # -- writes ---------------------------------------------------------------
    def _bump(self, gvp: tuple[str, str, str], kind: str, obj: Obj) -> None:
        self.revision = next(self.counter)
        obj["metadata"]["resourceVersion"] = str(self.revision)
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self.history.append((self.revision, gvp, event))
        for watched, queue in self.watchers:
            if watched == gvp:
                queue.put_nowait((self.revision, event))

    def _key(self, request: rendering.Request, name: str | None) -> Key:
        gvp = self._gvp(request)
        namespace = request.namespace if self._info(request)["namespaced"] else None
        if name is None:
            raise kmock.KubernetesError(status=422, reason="Invalid", message="metadata.name is required")
        return (*gvp, namespace, name)

    @staticmethod
    def _not_found(key: Key) -> kmock.KubernetesError:
        """404 worded as Kubernetes words it: ``disaggregatedroles.kvbridge.io "x" not found``."""
        group, _version, plural, _namespace, name = key
        resource = f"{plural}.{group}" if group else plural
        return kmock.KubernetesError(status=404, reason="NotFound", message=f'{resource} "{name}" not found')

    @staticmethod
    def _essence(obj: Obj) -> Obj:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

    async def _handle(self, request: rendering.Request) -> Any:
        if request.url.path == "/openapi/v3" or request.url.path.startswith("/openapi/v3/"):
            return await self._serve_openapi(request)
        # Resource requests go straight to this class (its state lives in `store`); kmock's reaction
        # routing re-checks every filter against every request and gets slower with each request served.
        resource = request.resource
        if resource is None or not resource.plural or request.action is None:
            return await kmock_k8s.KubernetesScaffold._handle(self, request)
        handlers = {
            kmock.action.LIST: self._serve_list,
            kmock.action.FETCH: self._serve_fetch,
            kmock.action.CREATE: self._serve_create,
            kmock.action.UPDATE: self._serve_update,
            kmock.action.DELETE: self._serve_delete,
        }
        raw_request = request._raw_request
        headers: Mapping[str, str] = raw_request.headers if raw_request is not None else {}
        self.calls[(headers.get("User-Agent", "").split("/", 1)[0], str(request.action), resource.plural)] += 1
        try:
            if self.faults is not None:
                fault = self.faults(str(request.action), resource.plural, headers)
                if fault is not None:
                    status, delay = fault
                    await asyncio.sleep(delay)
                    if status >= 400:
                        raise kmock.KubernetesError(status=status, reason="InjectedFault", message="injected fault")
            if request.action == kmock.action.WATCH:
                return await watches.stream(self, request)
            handler = handlers.get(request.action)
            if handler is None:
                raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message=str(request.action))
            if request.subresource and request.subresource not in self._info(request)["subresources"]:
                # a subresource the kind does not have (``kubectl scale`` of a DisaggregatedDeployment, ``logs``):
                # Kubernetes answers 404 and changes nothing, whatever the verb
                raise kmock.KubernetesError(
                    status=404, reason="NotFound", message="the server could not find the requested resource"
                )
            if request.subresource == "log":
                return await self._serve_log(request)
            warnings = self._validate_fields(request)
            result = await handler(request)
            if (
                request.action in (kmock.action.LIST, kmock.action.FETCH)
                and request.subresource is None
                and (tables.wants_table(headers.get("Accept", "")))
            ):
                result = tables.for_request(
                    self._info(request),
                    request.params,
                    result.get("items", [result]),
                    result["metadata"].get("resourceVersion", ""),
                )
            response = aiohttp.web.json_response(result)
            for warning in warnings:
                response.headers.add("Warning", f'299 - "{warning}"')
            return response
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)

    async def _serve_log(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """``pods/{name}/log`` (a read only): the container's log where the local kubelet keeps it."""
        key = self._key(request, request.name)
        if request.action != kmock.action.FETCH:
            raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message="pods/log is read only")
        async with self._lock:
            found = key in self.store
        if not found or request._raw_request is None:
            raise self._not_found(key)
        name, namespace = request.name or "", request.namespace or "default"
        source = self.pod_logs(namespace, name) if self.pod_logs else None
        return await pod_logs.serve(request._raw_request, request.params, name, source)

    def _validate_fields(self, request: rendering.Request) -> list[str]:
        """``fieldValidation`` on a write of a kind with a schema (the CRDs): ``Strict`` refuses unknown fields
        (HTTP 400, as Kubernetes), ``Warn`` (the API's default) answers them as warnings, ``Ignore`` drops the
        check. Returns the warnings."""
        directive = str(request.params.get("fieldValidation") or "Warn")
        if (
            request.action not in (kmock.action.CREATE, kmock.action.UPDATE)
            or request.subresource
            or (directive == "Ignore")
        ):
            return []
        info = self._info(request)
        body = request.data
        if body is None and request.text:
            with contextlib.suppress(yaml.YAMLError):
                body = yaml.safe_load(request.text)
        content_type = str(request.headers.get("Content-Type", "")).split(";")[0]
        if not info.get("schema") or not isinstance(body, dict) or content_type == "application/json-patch+json":
            return []
        unknown = openapi.unknown_fields(body, info["schema"])
        if unknown and directive == "Strict":
            kind, version = info["kind"], self._gvp(request)[1]
            fields = ", ".join(f'unknown field "{f}"' for f in unknown)
            raise kmock.KubernetesError(
                status=400,
                reason="BadRequest",
                message=(
                    f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: {fields}'
                ),
            )
        return [f'unknown field "{f}"' for f in unknown]

    @staticmethod
    def _manager(request: rendering.Request) -> str:
        """The field manager of a write: ``fieldManager``, else the User-Agent up to its first ``/`` (as Kubernetes)."""
        agent = str(request.headers.get("User-Agent", "")).split("/", 1)[0]
        return str(request.params.get("fieldManager") or agent or "unknown")

    async def _serve_create(self, request: rendering.Request) -> Obj:
        info, gvp = self._info(request), self._gvp(request)
        body = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        key = self._key(request, meta.get("name"))
        async with self._lock:
            if key in self.store:
                raise kmock.KubernetesError(
                    status=409, reason="AlreadyExists", message=f"{gvp[2]} {meta['name']!r} already exists"
                )
            if info["namespaced"]:
                meta["namespace"] = request.namespace
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
            body.setdefault("apiVersion", self._api_version(gvp))
            body.setdefault("kind", info["kind"])
            field_managers.record_update(None, body, self._manager(request), "status" in info["subresources"])
            self.store[key] = body
            self._bump(gvp, "ADDED", body)
            if gvp == ("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
                self._install_crd(body)
            return copy.deepcopy(body)

    async def _serve_update(self, request: rendering.Request) -> Obj:
        info, gvp = self._info(request), self._gvp(request)
        key = self._key(request, request.name)
        content_type = str(request.headers.get("Content-Type", "application/merge-patch+json")).split(";")[0]
        with_status = "status" in info["subresources"]
        if content_type == APPLY_PATCH and request.subresource is None:
            return await self._serve_apply(request, info, gvp, key)
        async with self._lock:
            current = self.store.get(key)
            if current is None:
                raise self._not_found(key)
            try:
                if request.subresource == "scale" and info.get("scale"):
                    patched = kinds.scaled(current, request.data, info["scale"])
                elif content_type == "application/json-patch+json":
                    patched = jsonpatch.apply_patch(current, request.data)
                else:  # merge and strategic-merge patches are merges here
                    patched = merge_patch(current, request.data)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=f"test failed: {exc}") from exc
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
            wanted_rv = (
                (request.data or {}).get("metadata", {}).get("resourceVersion")
                if isinstance(request.data, dict)
                else None
            )
            if wanted_rv and wanted_rv != current["metadata"].get("resourceVersion"):
                raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
            updated = copy.deepcopy(current)
            if request.subresource == "status":
                updated["status"] = patched.get("status", {})
            elif request.subresource == "scale":
                updated = patched
            else:
                for k, v in patched.items():
                    if k != "status" or "status" not in info["subresources"]:
                        updated[k] = v
                for k in [k for k in current if k not in patched and k != "status"]:
                    del updated[k]
                kept = {
                    f: current["metadata"][f]
                    for f in ("uid", "creationTimestamp", "generation", "namespace", "name")
                    if f in current["metadata"]
                }
                updated["metadata"] = {**patched.get("metadata", {}), **kept}
            if self._essence(updated) != self._essence(current):
                updated["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
            field_managers.record_update(current, updated, self._manager(request), with_status)
            if updated["metadata"].get("deletionTimestamp") and not updated["metadata"].get("finalizers"):
                del self.store[key]
                self._bump(gvp, "DELETED", updated)
                return copy.deepcopy(updated)
            self.store[key] = updated
            self._bump(gvp, "MODIFIED", updated)
            if request.subresource == "scale":  # a write to /scale answers with the Scale, as Kubernetes
                return kinds.scale_of(updated, info["scale"])
            return copy.deepcopy(updated)

    async def _serve_apply(
        self, request: rendering.Request, info: dict[str, Any], gvp: tuple[str, str, str], key: Key
    ) -> Obj:
        """Server-side apply (``application/apply-patch+yaml``): create or update, owning fields (field_managers)."""
        config = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text or "null")
        if not isinstance(config, dict) or config.get("metadata", {}).get("name") not in (None, request.name):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="apply: an object named as the URL")
        force = str(request.params.get("force", "false")).lower() == "true"
        manager = request.params.get("fieldManager")
        if not manager:
            raise kmock.KubernetesError(
                status=422, reason="Invalid", message="fieldManager is required for apply patch"
            )
        async with self._lock:
            current = self.store.get(key)
            try:
                result = field_managers.apply(current, config, manager, force, "status" in info["subresources"])
            except field_managers.ConflictError as exc:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=str(exc)) from exc
            meta = result["metadata"]
            if current is None:
                if info["namespaced"]:
                    meta["namespace"] = request.namespace
                meta.update(name=request.name, uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
                result.setdefault("apiVersion", self._api_version(gvp))
                result.setdefault("kind", info["kind"])
                self.store[key] = result
                self._bump(gvp, "ADDED", result)
                return copy.deepcopy(result)
            if self._essence(result) != self._essence(current):
                meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
            if result == current:  # nothing changed: no new resourceVersion, no watch event (as Kubernetes)
                return copy.deepcopy(current)
            self.store[key] = result
            self._bump(gvp, "MODIFIED", result)
            return copy.deepcopy(result)

    async def _serve_delete(self, request: rendering.Request) -> Obj:
        gvp = self._gvp(request)
        key = self._key(request, request.name)
        async with self._lock:
            current = self.store.get(key)
            if current is None:
                raise self._not_found(key)
            if current["metadata"].get("finalizers"):
                if not current["metadata"].get("deletionTimestamp"):
                    current["metadata"]["deletionTimestamp"] = now_rfc3339()
                    self._bump(gvp, "MODIFIED", current)
                return copy.deepcopy(current)
            del self.store[key]
            self._bump(gvp, "DELETED", current)
            return copy.deepcopy(current)

    # -- reads ----------------------------------------------------------------
    def _matching(self, request: rendering.Request) -> list[Obj]:
        gvp = self._gvp(request)
        labels, fields = request.params.get("labelSelector", ""), request.params.get("fieldSelector", "")
        found = []
        for (group, version, plural, namespace, _name), obj in self.store.items():
            if (group, version, plural) != gvp or (request.namespace and namespace != request.namespace):
                continue
            if labels and not label_match(labels, obj["metadata"].get("labels") or {}):
                continue
            if fields and not field_match(fields, obj):
                continue
            found.append(copy.deepcopy(obj))
        return sorted(found, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    async def _serve_fetch(self, request: rendering.Request) -> Obj:
        info, key = self._info(request), self._key(request, request.name)
        async with self._lock:
            current = self.store.get(key)
        if current is None:
            raise self._not_found(key)
        if request.subresource == "scale" and info.get("scale"):
            return kinds.scale_of(current, info["scale"])
        return copy.deepcopy(current)

    async def _serve_list(self, request: rendering.Request) -> Obj:
        info, gvp = self._info(request), self._gvp(request)
        async with self._lock:
            items = self._matching(request)
            revision = self.revision
        return {
            "apiVersion": self._api_version(gvp),
            "kind": f"{info['kind']}List",
            "metadata": {"resourceVersion": str(revision)},
            "items": items,
        }

    # -- discovery --------------------------------------------------------------
    async def _serve_version(self, request: rendering.Request) -> Obj:
        """``/api/v1``, ``/apis/GROUP/VERSION``: the APIResourceList (kinds.api_resource_list)."""
        if request.resource is None:  # pragma: no cover - the route has a group-version
            raise kmock_k8s.KubernetesResourceNotFoundError()
        group, version = request.resource.group or "", request.resource.version or "v1"
        found = kinds.api_resource_list(self.kinds, group, version, VERBS)
        if found is None:
            raise kmock_k8s.KubernetesResourceNotFoundError()
        return found

    async def _serve_openapi(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """``/openapi/v3`` and its per-group-version documents (openapi)."""
        group_versions = {(g, v) for g, v, _p in self.kinds}
        schemas = {gvp: info["schema"] for gvp, info in self.kinds.items() if info.get("schema")}
        documents = {
            openapi.group_version_path(g, v): openapi.document(g, v, self.kinds, schemas) for g, v in group_versions
        }
        wanted = request.url.path.removeprefix("/openapi/v3").strip("/")
        if not wanted:
            return aiohttp.web.json_response(openapi.root(group_versions, documents))
        if wanted not in documents:
            return await self._render_error(kmock_k8s.KubernetesEndpointNotFoundError())
        return aiohttp.web.json_response(documents[wanted])

    # -- helpers for tests ------------------------------------------------------
    def objects_of(self, plural: str, namespace: str | None = None) -> list[Obj]:
        return [
            copy.deepcopy(o)
            for (_g, _v, p, ns, _n), o in self.store.items()
            if p == plural and (namespace is None or ns == namespace)
        ]

    def peek(self, plural: str) -> list[Obj]:
        """The stored objects themselves (no copies): read-only, for cheap polling in benchmarks."""
        return [o for (_g, _v, p, _ns, _n), o in self.store.items() if p == plural]

    def find(self, plural: str, namespace: str | None, name: str) -> Obj | None:
        for (_g, _v, p, ns, n), obj in self.store.items():
            if p == plural and ns == namespace and n == name:
                return copy.deepcopy(obj)
        return None
