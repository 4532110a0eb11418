"""The Kopf handlers: thin, they only call :func:`reconcile` (one lock per resource).

``build_registry`` registers everything on a fresh registry, so tests can
run several operators in one process.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
import time
from collections import defaultdict
from typing import Any

import aiohttp
import kopf

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import GROUP, LABEL_DEPLOYMENT, PLURAL, ROLE_PLURAL, VERSION, role_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.backoff import OPERATOR_BACKOFF
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.autoscaling import may_be_due, plan_pass
from kvbridge_operator.controller.decide import ExistingChildren
from kvbridge_operator.controller.metrics import RECONCILE_SECONDS, RECONCILES, serve
from kvbridge_operator.controller.reconcile import reconcile
from kvbridge_operator.kube import DEPLOYMENTS, ApiError, Connection, KubeClient, connect

PREFIX = "kvbridge.io"
#: the finalizer Kopf puts on every DisaggregatedDeployment: the resync timer below needs one (Kopf stops an object's
#: timers before it lets the object go); released as soon as the timer stopped, so a delete waits for nothing else
FINALIZER = f"{PREFIX}/finalizer"
#: failures of the Kubernetes API that a later try may not meet (after the client's own retries)
API_ERRORS = (ApiError, aiohttp.ClientError, TimeoutError)
#: period of the level-triggered resync of every deployment (seconds); each resync is a full reconcile (9 API calls,
#: server-side applies that change nothing when nothing changed: see docs/operator.md)
RESYNC_SECONDS = 60.0
#: how often the planner's timer looks whether a deployment's pass is due (spec.autoscaling.intervalSeconds >= 5)
PLANNER_TICK_SECONDS = 5.0
#: tries for the reconcile a pod event triggers (about 6 minutes at the backoff's cap)
POD_EVENT_ATTEMPTS = 100


#: the deepest JSON the Kubernetes API server decodes, and so stores (apimachinery's util/json and Go's
#: encoding/json both stop at 10,000 levels)
API_JSON_DEPTH = 10_000
#: the operator process's recursion limit: two Python frames per level of such an object (JSON decoding, copies
#: and diffs in Kopf and the API client) and the frames of the calls around them
OPERATOR_RECURSION_LIMIT = 2 * API_JSON_DEPTH + 5_000


def allow_api_depth() -> None:
    """Let this process decode every object the API server can store. Python's JSON decoder (Kopf's watches, the
    API client) recurses once per level, under the interpreter's recursion limit (1,000 by default): a
    DisaggregatedDeployment nested 3,000 levels deep, which the API server stores, made Kopf's watcher of every
    DisaggregatedDeployment fail with RecursionError (no deployment was reconciled after it). Decoded, it is
    refused in its own status (parse_deployment bounds depth without recursion: NESTING_TOO_DEEP). The C stack
    that the deepest object takes (json, copy.deepcopy and repr recurse in C) is about 2 MiB of the main thread's
    8 MiB, measured at 10,000 levels."""
    if sys.getrecursionlimit() < OPERATOR_RECURSION_LIMIT:
        sys.setrecursionlimit(OPERATOR_RECURSION_LIMIT)


def configure_settings(settings: kopf.OperatorSettings) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.posting.enabled = False  # the operator posts its own events (Incompatible, Reconciled, ...)
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.queueing.error_delays = OPERATOR_BACKOFF  # capped exponential with jitter (backoff.py)
    settings.networking.error_backoffs = OPERATOR_BACKOFF
    settings.scanning.disabled = True  # one discovery at start-up: no CRD/namespace watches, no extra RBAC


def connection_info(connection: Connection) -> kopf.ConnectionInfo:
    configuration = connection.configuration
    return kopf.ConnectionInfo(
        server=str(configuration.host),
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        token=connection.token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


#: the indexes handlers receive (as keyword arguments named by the ids): a deployment's pods, StatefulSets,
#: DisaggregatedRoles and LeaderWorkerSets
INDEXES = ("pods_by_deployment", "sets_by_deployment", "roles_by_deployment", "groups_by_deployment")
Indexes = dict[str, Any]


def children_from(indexes: Indexes, namespace: str, name: str) -> ExistingChildren:
    """A deployment's children as the operator's watches last saw them."""

    def of(index: str) -> list[Obj]:
        store = indexes[index].get((namespace, name))
        return list(store) if store is not None else []

    def by_role(objects: list[Obj]) -> dict[Role, Obj | None]:
        named = {obj["metadata"]["name"]: obj for obj in objects}
        return {role: named.get(role_name(name, role)) for role in Role}

    pods, stateful_sets, roles, leader_worker_sets = (of(index) for index in INDEXES)
    return ExistingChildren(by_role(roles), by_role(stateful_sets), pods, by_role(leader_worker_sets))


def _handler_id(name: str) -> str:
    """The id Kopf knows a handler by (and keeps in a deployment's annotations while the handler is retried): the
    name it had when one function defined every handler, kept so an upgraded operator resumes what it retried."""
    return f"build_registry.<locals>.{name}"


class _Reconciles:
    """The reconciles the handlers run: one at a time per resource, from a fresh read of it."""

    def __init__(self, config: OperatorConfig, client: KubeClient) -> None:
        self.config = config
        self.client = client
        self.locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    async def run(self, namespace: str, name: str, indexes: Indexes, apply_children: bool = True) -> None:
        """Reconcile from a fresh read of the resource, one at a time per resource (events may carry stale
        bodies); its children come from the operator's watch indexes (no API reads)."""
        async with self.locks[(namespace, name)]:
            body = await self.client.get(DEPLOYMENTS, namespace, name)
            if body is None:  # it may be gone by now (its pods drain after it)
                return
            with RECONCILE_SECONDS.time():
                try:
                    cached = children_from(indexes, namespace, name)
                    outcome = await reconcile(self.client, body, self.config, apply_children, cached)
                except Exception:
                    RECONCILES.labels(result="error").inc()
                    raise
            result = "applied" if outcome.applied else "refused" if apply_children else "observed"
            RECONCILES.labels(result=result).inc()

    async def observe(self, namespace: str, name: str, what: str, indexes: Indexes) -> None:
        """A status-only reconcile (it applies only where the running counts are not the effective ones). Event
        handlers are not retried by Kopf, and an event may be the last one for a while (the one that makes the
        deployment Ready): retry API failures here, with the same backoff."""
        for attempt in range(POD_EVENT_ATTEMPTS):
            try:
                await self.run(namespace, name, indexes, apply_children=False)
                return
            except API_ERRORS as exc:
                if attempt == POD_EVENT_ATTEMPTS - 1:
                    raise
                logging.getLogger(__name__).info("%s: Kubernetes API: %s; retrying", what, exc)
                await asyncio.sleep(OPERATOR_BACKOFF.delay(attempt))


def build_registry(config: OperatorConfig, client: KubeClient) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    reconciles = _Reconciles(config, client)
    _register_setup(registry, config)
    _register_deployment_handlers(registry, reconciles)
    _register_planner(registry, client)
    _register_child_events(registry, reconciles)
    return registry


def _register_setup(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Kopf's settings, the watch indexes of the children and the login."""

    @kopf.on.startup(registry=registry, id=_handler_id("startup"))
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings)

    # what the reconcile reads of the children, kept current by the operator's own watches (Kopf indexes are
    # filled before any handler runs): a pod event costs the resource read and the status write, not the reads of
    # reconcile.read_children
    def by_deployment(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> Any:
        return {(namespace or "default", labels[LABEL_DEPLOYMENT]): copy.deepcopy(dict(body))}

    owned = {LABEL_DEPLOYMENT: kopf.PRESENT}
    kopf.index("v1", "pods", labels=owned, registry=registry, id=INDEXES[0])(by_deployment)
    kopf.index("apps", "v1", "statefulsets", labels=owned, registry=registry, id=INDEXES[1])(by_deployment)
    kopf.index(GROUP, VERSION, ROLE_PLURAL, labels=owned, registry=registry, id=INDEXES[2])(by_deployment)
    # engines spanning nodes: served only where the LeaderWorkerSet CRD is installed (Kopf skips it elsewhere)
    kopf.index("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=owned, registry=registry, id=INDEXES[3])(
        by_deployment
    )

    @kopf.on.login(registry=registry, id=_handler_id("login"))
    async def login(**_: Any) -> kopf.ConnectionInfo:
        """Kopf's watches use the credentials of the operator's own client, loaded afresh on every login (Kopf logs
        in again on a 401: a rotated service-account token, an expired exec-plugin token)."""
        return connection_info(await connect(config.api_server, config.kubeconfig, config.context))


def _register_deployment_handlers(registry: kopf.OperatorRegistry, reconciles: _Reconciles) -> None:
    """A deployment created, its spec changed, the operator resumed; and the periodic resync."""
    changed = _handler_id("deployment_changed")

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, id=changed)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry, id=changed)
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, id=changed)
    async def deployment_changed(name: str, namespace: str | None, retry: int, **kwargs: Any) -> None:
        try:
            await reconciles.run(namespace or "default", name, _indexes(kwargs))
        except API_ERRORS as exc:  # the API is down or overloaded: retry soon
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=OPERATOR_BACKOFF.delay(retry)) from exc

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=RESYNC_SECONDS,
        initial_delay=RESYNC_SECONDS,
        registry=registry,
        id=_handler_id("resync"),
    )
    async def resync(name: str, namespace: str | None, **kwargs: Any) -> None:
        """Level-triggered safety net, as Kubernetes' own controllers resync: an event lost to API errors (Kopf
        skips events of an object while it throttles that object's errors) is made up within this period."""
        try:
            await reconciles.run(namespace or "default", name, _indexes(kwargs))
        except API_ERRORS as exc:
            logging.getLogger(__name__).info("resync of %s/%s: Kubernetes API: %s", namespace, name, exc)


def _register_planner(registry: kopf.OperatorRegistry, client: KubeClient) -> None:
    """kvbridge's planner (spec.autoscaling): a timer per planning deployment, one HTTP session for every pass."""
    planner_session: list[aiohttp.ClientSession] = []  # made on first use

    @kopf.on.cleanup(registry=registry, id=_handler_id("close_planner"))
    async def close_planner(**_: Any) -> None:
        while planner_session:
            await planner_session.pop().close()

    def planning(spec: kopf.Spec, **_: Any) -> bool:
        return bool((spec.get("autoscaling") or {}).get("enabled"))

    @kopf.timer(
        GROUP, VERSION, PLURAL, interval=PLANNER_TICK_SECONDS, when=planning, registry=registry, id=_handler_id("plan")
    )
    async def plan(name: str, namespace: str | None, body: kopf.Body, **_: Any) -> None:
        """kvbridge's planner (spec.autoscaling): a pass when one is due (controller.autoscaling). A pass that
        fails is logged and tried again at the next tick; it changes nothing that runs."""
        if not may_be_due(dict(body), time.time()):
            return
        if not planner_session:
            planner_session.append(aiohttp.ClientSession())
        try:
            fresh = await client.get(DEPLOYMENTS, namespace or "default", name)
            if fresh is not None:
                await plan_pass(client, planner_session[0], fresh)
        except API_ERRORS as exc:
            logging.getLogger(__name__).info("planner, %s/%s: Kubernetes API: %s", namespace, name, exc)
        except Exception:  # a planner bug must not stop the reconciles, nor this timer: logged, tried next tick
            logging.getLogger(__name__).exception("planner, %s/%s: the pass failed", namespace, name)


def _register_child_events(registry: kopf.OperatorRegistry, reconciles: _Reconciles) -> None:
    """A pod of a deployment changed, or a role was scaled: a status-only reconcile."""

    @kopf.on.event(
        "v1", "pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT}, registry=registry, id=_handler_id("pod_changed")
    )
    async def pod_changed(labels: kopf.Labels, namespace: str | None, **kwargs: Any) -> None:
        # a pod changes no spec: observe and write the status only
        await reconciles.observe(namespace or "default", labels[LABEL_DEPLOYMENT], "pod event", _indexes(kwargs))

    @kopf.on.event(GROUP, VERSION, ROLE_PLURAL, registry=registry, id=_handler_id("role_scaled"))
    async def role_scaled(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
        """An autoscaler or `kubectl scale` changed a role's replicas: run the new effective counts. The operator's
        own status writes (desiredReplicas caught up) and deletions do nothing."""
        spec, status = body.get("spec") or {}, body.get("status") or {}
        if body.get("metadata", {}).get("deletionTimestamp") or spec.get("replicas") == status.get("desiredReplicas"):
            return
        await reconciles.observe(
            namespace or "default", str(spec.get("deployment", "")), "role scaled", _indexes(kwargs)
        )


def _indexes(kwargs: dict[str, Any]) -> Indexes:
    return {name: kwargs[name] for name in INDEXES}


async def run_operator(
    config: OperatorConfig,
    stop_flag: asyncio.Event | None = None,
    client: KubeClient | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    """Run until ``stop_flag`` is set (or forever): one replica, standalone, liveness endpoint on."""
    logging.getLogger("kopf").setLevel(logging.INFO)
    allow_api_depth()
    if client is None:
        connection = await connect(config.api_server, config.kubeconfig, config.context)
        logging.getLogger(__name__).info("Kubernetes API: %s (%s)", connection.configuration.host, connection.source)
        client = KubeClient(connection)
    serve(config.metrics_port)
    try:
        await kopf.operator(
            registry=build_registry(config, client),
            standalone=True,
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            liveness_endpoint=f"http://0.0.0.0:{config.liveness_port}/healthz" if config.liveness_port else None,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        await client.close()
