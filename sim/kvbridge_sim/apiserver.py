"""A realistic enough Kubernetes API for Kopf, the operator and ``kubectl``: kmock's emulator plus what they rely on.

kmock 0.8's ``KubernetesEmulator`` keeps objects as plain merged dicts. This
subclass adds (docs/development.md): ``uid``,
``creationTimestamp``, ``generation`` bumped on spec changes only, a fresh
``resourceVersion`` on every write, ``generateName``, the verbs as a real server
serves them: create (201; ``dryRun``), update (PUT: a replace, ``resourceVersion``
checked), patch (JSON, merge and strategic merge patches, patches), server-side apply
with field managers and ``metadata.managedFields`` (field_managers), delete with its
options and the garbage collector's part (deletion), deletecollection; status and
scale subresources, watches that subscribe before the snapshot and honour
``resourceVersion`` and ``timeoutSeconds``, typed lists, ``/api/v1`` discovery, label
and field selectors, cluster-scoped namespaces and CRDs that register their resource;
and what the real ``kubectl`` needs: discovery as Kubernetes lists it, OpenAPI v3
(openapi), server-side Tables (tables), refusals worded as Kubernetes words them
(api_errors), pods' container logs (pod_logs).

It validates custom resources only for unknown fields (``fieldValidation``): tests
validate objects separately.
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
import kmock
import yaml
from kmock._internal import k8s as kmock_k8s
from kmock._internal import rendering

from kvbridge_operator.api.objects import Obj, now_rfc3339
from kvbridge_sim import api_errors, deletion, field_managers, kinds, openapi, patches, pod_logs, tables, watches
from kvbridge_sim.api_errors import Key
from kvbridge_sim.selectors import field_match, label_match

VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}


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
        custom: bool = False,
    ) -> None:
        self.kinds[(group, version, plural)] = {
            "kind": kind,
            "custom": custom,
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
        for (group, version, plural), info in kinds.of_crd(crd).items():
            self.declare(group, version, plural, **info, custom=True)

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

    def _list(self, gvp: tuple[str, str, str], info: dict[str, Any], revision: int, items: list[Obj]) -> Obj:
        """A kind's List of ``items`` as of ``revision``."""
        return {
            "apiVersion": self._api_version(gvp),
            "kind": f"{info['kind']}List",
            "metadata": {"resourceVersion": str(revision)},
            "items": items,
        }

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
    def _essence(obj: Obj) -> Obj:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

    @staticmethod
    def _verb(request: rendering.Request) -> str | None:
        """The Kubernetes verb of a resource request (kmock's action, or from the method where it has none)."""
        if request.action is not None:
            return str(request.action)
        if request.method == kmock.method.PUT and request.name is not None:
            return "replace"
        if request.method == kmock.method.DELETE and request.name is None:
            return "deletecollection"
        return None

    async def _handle(self, request: rendering.Request) -> Any:
        if request.url.path == "/openapi/v3" or request.url.path.startswith("/openapi/v3/"):
            return await self._serve_openapi(request)
        # Resource requests go straight to this class (its state lives in `store`); kmock's reaction
        # routing re-checks every filter against every request and gets slower with each request served.
        resource, verb = request.resource, self._verb(request)
        if resource is None or not resource.plural or (verb is None and request.method is None):
            return await kmock_k8s.KubernetesScaffold._handle(self, request)
        raw_request = request._raw_request
        headers: Mapping[str, str] = raw_request.headers if raw_request is not None else {}
        self.calls[(headers.get("User-Agent", "").split("/", 1)[0], str(verb), resource.plural)] += 1
        try:
            if self.faults is not None:
                fault = self.faults(str(verb), resource.plural, headers)
                if fault is not None:
                    status, delay = fault
                    await asyncio.sleep(delay)
                    if status >= 400:
                        raise kmock.KubernetesError(status=status, reason="InjectedFault", message="injected fault")
            if request.action == kmock.action.WATCH:
                return await watches.stream(self, request)
            return await self._serve_resource(request, verb, headers)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)

    async def _serve_resource(
        self, request: rendering.Request, verb: str | None, headers: Mapping[str, str]
    ) -> aiohttp.web.StreamResponse:
        handlers = {
            str(kmock.action.LIST): self._serve_list,
            str(kmock.action.FETCH): self._serve_fetch,
            str(kmock.action.CREATE): self._serve_create,
            str(kmock.action.UPDATE): self._serve_update,
            "replace": self._serve_update,
            str(kmock.action.DELETE): self._serve_delete,
            "deletecollection": self._serve_delete_collection,
        }
        handler = handlers.get(str(verb))
        if handler is None:
            raise kmock.KubernetesError(
                status=405,
                reason="MethodNotAllowed",
                message="the server does not allow this method on the requested resource",
            )
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
        reads = (str(kmock.action.LIST), str(kmock.action.FETCH))
        if verb in reads and request.subresource is None and tables.wants_table(headers.get("Accept", "")):
            result = tables.for_request(
                self._info(request),
                request.params,
                result.get("items", [result]),
                result["metadata"].get("resourceVersion", ""),
            )
        response = aiohttp.web.json_response(result, status=201 if verb == str(kmock.action.CREATE) else 200)
        for warning in warnings:
            response.headers.add("Warning", f'299 - "{warning}"')
        return response

    async def _serve_log(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """``pods/{name}/log`` (a read only): the container's log where the local kubelet keeps it."""
        key = self._key(request, request.name)
        if request.action != kmock.action.FETCH:
            raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message="pods/log is read only")
        async with self._lock:
            pod = copy.deepcopy(self.store.get(key))
        if pod is None or request._raw_request is None:
            raise api_errors.not_found(key)
        name, namespace = request.name or "", request.namespace or "default"
        source = self.pod_logs(namespace, name) if self.pod_logs else None
        return await pod_logs.serve(request._raw_request, request.params, pod, source)

    def _validate_fields(self, request: rendering.Request) -> list[str]:
        """``fieldValidation`` of a create or update of a kind with a schema (the CRDs; openapi.validate_fields)."""
        if self._verb(request) not in (str(kmock.action.CREATE), str(kmock.action.UPDATE), "replace"):
            return []
        content_type = str(request.headers.get("Content-Type", "")).split(";")[0]
        if request.subresource or content_type == patches.JSON_PATCH:
            return []
        body = request.data
        if body is None and request.text:
            with contextlib.suppress(yaml.YAMLError):
                body = yaml.safe_load(request.text)
        directive = str(request.params.get("fieldValidation") or "Warn")
        return openapi.validate_fields(directive, body, self._info(request), self._gvp(request)[1])

    @staticmethod
    def _manager(request: rendering.Request) -> str:
        """The field manager of a write: ``fieldManager``, else the User-Agent up to its first ``/`` (as Kubernetes)."""
        agent = str(request.headers.get("User-Agent", "")).split("/", 1)[0]
        return str(request.params.get("fieldManager") or agent or "unknown")

    @staticmethod
    def _dry_run(request: rendering.Request) -> bool:
        """``?dryRun=All``: the write is checked and answered, and not stored (``kubectl --dry-run=server``)."""
        return request.params.get("dryRun") == "All"

    def _commit(self, key: Key, obj: Obj, kind: str, request: rendering.Request) -> Obj:
        """Store a written object and tell the watchers, unless the write is a dry run; what the write answers."""
        if not self._dry_run(request):
            self.store[key] = obj
            self._bump(key[:3], kind, obj)
        return copy.deepcopy(obj)

    async def _serve_create(self, request: rendering.Request) -> Obj:
        info, gvp = self._info(request), self._gvp(request)
        body = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        key = self._key(request, meta.get("name"))
        if info["namespaced"] and meta.get("namespace") not in (None, request.namespace):
            raise api_errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )
        async with self._lock:
            if key in self.store:
                raise api_errors.already_exists(key)
            if info["namespaced"]:
                meta["namespace"] = request.namespace
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
            body.setdefault("apiVersion", self._api_version(gvp))
            body.setdefault("kind", info["kind"])
            field_managers.record_update(None, body, self._manager(request), "status" in info["subresources"])
            created = self._commit(key, body, "ADDED", request)
            if gvp == ("apiextensions.k8s.io", "v1", "customresourcedefinitions") and not self._dry_run(request):
                self._install_crd(body)
            return created

    async def _serve_update(self, request: rendering.Request) -> Obj:
        """PATCH (any patch type, server-side apply) and PUT (a replace)."""
        info = self._info(request)
        key = self._key(request, request.name)
        content_type = str(request.headers.get("Content-Type", "")).split(";")[0]
        if content_type == patches.APPLY_PATCH and request.subresource is None and self._verb(request) != "replace":
            return await self._serve_apply(request, info, self._gvp(request), key)
        async with self._lock:
            current = self.store.get(key)
            if current is None:
                raise api_errors.not_found(key)
            content_type = content_type or patches.MERGE_PATCH
            updated = patches.changed(
                current, request.data, (self._verb(request), request.subresource, content_type), info, key
            )
            if self._essence(updated) != self._essence(current):
                updated["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
            field_managers.record_update(current, updated, self._manager(request), "status" in info["subresources"])
            if updated["metadata"].get("deletionTimestamp") and not updated["metadata"].get("finalizers"):
                return self._remove(key, updated, request)  # its last finalizer released: the object goes
            answer = self._commit(key, updated, "MODIFIED", request)
            if request.subresource == "scale":  # a write to /scale answers with the Scale, as Kubernetes
                return kinds.scale_of(updated, info["scale"])
            return answer

    async def _serve_apply(
        self, request: rendering.Request, info: dict[str, Any], gvp: tuple[str, str, str], key: Key
    ) -> Obj:
        """Server-side apply (``application/apply-patch+yaml``): create or update, owning fields (field_managers)."""
        config = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text or "null")
        if not isinstance(config, dict) or config.get("metadata", {}).get("name") not in (None, request.name):
            raise api_errors.bad_request("apply: an object named as the URL")
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
                return self._commit(key, result, "ADDED", request)
            if self._essence(result) != self._essence(current):
                meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
            if result == current:  # nothing changed: no new resourceVersion, no watch event (as Kubernetes)
                return copy.deepcopy(current)
            return self._commit(key, result, "MODIFIED", request)

    async def _serve_delete(self, request: rendering.Request) -> Obj:
        key = self._key(request, request.name)
        options = deletion.delete_options(request.params, request.data)
        async with self._lock:
            current = self.store.get(key)
            if current is None:
                raise api_errors.not_found(key)
            deletion.check_preconditions(options, current, key)
            if options.dry_run:
                return copy.deepcopy(current)
            return self._delete(key, current, options.propagation)

    async def _serve_delete_collection(self, request: rendering.Request) -> Obj:
        """DELETE of a collection: every object the selectors match (each as a DELETE of it); the list of them."""
        info, gvp = self._info(request), self._gvp(request)
        options = deletion.delete_options(request.params, request.data)
        async with self._lock:
            matching = self._matching(request)
            items = []
            for obj in matching:
                key = (*gvp, obj["metadata"].get("namespace") if info["namespaced"] else None, obj["metadata"]["name"])
                if key in self.store:
                    items.append(obj if options.dry_run else self._delete(key, self.store[key], options.propagation))
            revision = self.revision
        return self._list(gvp, info, revision, items)

    def _delete(self, key: Key, current: Obj, propagation: str) -> Obj:
        """Delete a stored object (the lock held): a deletion timestamp while finalizers hold it, else gone, its
        dependents after it (deletion); ``Orphan`` leaves them, without their reference to it."""
        uid = str(current["metadata"].get("uid", ""))
        if propagation == "Orphan":
            for dependent in deletion.dependents(self.store, uid):
                self.store[dependent] = deletion.orphaned(self.store[dependent], uid)
                self._bump(dependent[:3], "MODIFIED", self.store[dependent])
        if current["metadata"].get("finalizers"):
            if not current["metadata"].get("deletionTimestamp"):
                current["metadata"]["deletionTimestamp"] = now_rfc3339()
                self._bump(key[:3], "MODIFIED", current)
            return copy.deepcopy(current)
        return self._remove(key, current)

    def _remove(self, key: Key, obj: Obj, request: rendering.Request | None = None) -> Obj:
        """An object leaves the store (the lock held), then the garbage collector deletes its dependents."""
        if request is not None and self._dry_run(request):
            return copy.deepcopy(obj)
        self.store.pop(key, None)
        self._bump(key[:3], "DELETED", obj)
        for dependent in deletion.dependents(self.store, str(obj["metadata"].get("uid", ""))):
            if dependent in self.store:
                self._delete(dependent, self.store[dependent], "Background")
        return copy.deepcopy(obj)

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
            raise api_errors.not_found(key)
        if request.subresource == "scale" and info.get("scale"):
            return kinds.scale_of(current, info["scale"])
        return copy.deepcopy(current)

    async def _serve_list(self, request: rendering.Request) -> Obj:
        info, gvp = self._info(request), self._gvp(request)
        async with self._lock:
            items = self._matching(request)
            revision = self.revision
        return self._list(gvp, info, revision, items)

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
