"""What a reconcile does to the API, as values: the pure decision (decide.py) lists them, apply.py carries them out."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.kube import Resource


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class CreateOnce:
    """Create the object; one that exists is kept as it is (the side channel's Secret: rotation is explicit)."""

    resource: Resource
    obj: Obj


@dataclass(frozen=True)
class EnsureRole:
    """The role's DisaggregatedRole: created as ``obj`` when it does not exist (``exists`` false); else its
    ``spec.replicas`` set to ``replicas`` when the deployment's replicas changed since they were last written (from a
    fresh read, so what an autoscaler set in between is seen)."""

    obj: Obj
    exists: bool
    replicas: int


@dataclass(frozen=True)
class Apply:
    """Server-side apply under kvbridge's field manager. ``optional``: a kind some clusters do not serve (their CRD
    not installed); the API's 404 then tells the reconcile, which decides again without it."""

    obj: Obj
    optional: bool = False


@dataclass(frozen=True)
class Delete:
    resource: Resource
    namespace: str
    name: str


@dataclass(frozen=True)
class WriteStatus:
    resource: Resource
    namespace: str
    name: str
    status: Obj


@dataclass(frozen=True)
class Annotate:
    resource: Resource
    namespace: str
    name: str
    annotations: dict[str, str]


@dataclass(frozen=True)
class Post:
    """An Event about the deployment (failures to post are logged, never fail the reconcile)."""

    involved: Obj  # the deployment's metadata
    event: Event


Action = CreateOnce | EnsureRole | Apply | Delete | WriteStatus | Annotate | Post
