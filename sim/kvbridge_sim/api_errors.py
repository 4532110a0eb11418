"""The emulated API's refusals worded as a Kubernetes API server words them: the Status it answers (its reason and
message, and details naming the object, where kmock would put a Python traceback), so that ``kubectl`` prints what
it prints against a cluster."""

from __future__ import annotations

import kmock

from kvbridge_operator.api.objects import Obj

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name
#: why an update whose resourceVersion is not the object's is refused
MODIFIED = "the object has been modified; please apply your changes to the latest version and try again"


def resource(key: Key) -> str:
    """``statefulsets.apps``, ``pods``: how Kubernetes names a kind of object in its messages."""
    group, _version, plural, _namespace, _name = key
    return f"{plural}.{group}" if group else plural


def details(key: Key) -> Obj:
    group, _version, plural, _namespace, name = key
    return {"name": name, "group": group, "kind": plural}


def not_found(key: Key) -> kmock.KubernetesError:
    """404: ``disaggregatedroles.kvbridge.io "x" not found``."""
    message = f'{resource(key)} "{key[4]}" not found'
    return kmock.KubernetesError(status=404, reason="NotFound", message=message, details=details(key))


def already_exists(key: Key) -> kmock.KubernetesError:
    """409 on a create: ``configmaps "x" already exists``."""
    message = f'{resource(key)} "{key[4]}" already exists'
    return kmock.KubernetesError(status=409, reason="AlreadyExists", message=message, details=details(key))


def conflict(key: Key, why: str = MODIFIED) -> kmock.KubernetesError:
    """409 on a write whose precondition failed: ``Operation cannot be fulfilled on pods "x": ...``."""
    message = f'Operation cannot be fulfilled on {resource(key)} "{key[4]}": {why}'
    return kmock.KubernetesError(status=409, reason="Conflict", message=message, details=details(key))


def invalid(kind: str, key: Key, field: str, why: str) -> kmock.KubernetesError:
    """422: ``DisaggregatedDeployment.kvbridge.io "x" is invalid: FIELD: WHY``."""
    group = f".{key[0]}" if key[0] else ""
    message = f'{kind}{group} "{key[4]}" is invalid: {field}: {why}'
    return kmock.KubernetesError(status=422, reason="Invalid", message=message, details=details(key))


def bad_request(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=400, reason="BadRequest", message=message, details={})
