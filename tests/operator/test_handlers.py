"""The Kopf handlers' ids: what Kopf keeps in a deployment's annotations while it retries a handler, so they must
not change when the code that registers them is reorganised (an upgraded operator resumes what it retried)."""

from __future__ import annotations

from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.handlers import INDEXES, build_registry
from kvbridge_operator.kube import KubeClient


def test_the_handler_ids_are_the_ones_kopf_has_stored() -> None:
    registry = build_registry(OperatorConfig(), KubeClient.for_url("http://127.0.0.1:1"))
    kinds = (
        registry._changing,
        registry._watching,
        registry._spawning,
        registry._activities,
        registry._indexing,
    )
    ids = sorted(handler.id for kind in kinds for handler in kind.get_all_handlers())
    local = "build_registry.<locals>."
    assert ids == sorted(
        [
            *[f"{local}deployment_changed"] * 2,  # on create and on resume
            f"{local}deployment_changed/spec",  # on update of the spec
            f"{local}pod_changed",
            f"{local}role_scaled",
            f"{local}resync",
            f"{local}plan",
            f"{local}startup",
            f"{local}login",
            f"{local}close_planner",
            *INDEXES,
        ]
    )
