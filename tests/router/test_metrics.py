"""The router's metrics are one table (metrics.METRICS): each is the attribute it names, of the kind it says, its
name written once."""

from __future__ import annotations

from typing import get_type_hints

from kvbridge_router.metrics import METRICS, RouterMetrics


def test_every_metric_of_the_table_is_its_attribute_of_its_kind() -> None:
    metrics = RouterMetrics()
    declared = {name: kind for name, kind in get_type_hints(RouterMetrics).items() if not name.startswith("_")}
    assert set(declared) == set(METRICS)
    for attribute, metric in METRICS.items():
        assert declared[attribute] is metric.kind
        assert isinstance(getattr(metrics, attribute), metric.kind)
    names = [metric.name for metric in METRICS.values()]
    assert len(set(names)) == len(names)
    assert all(name.startswith("kvbridge_router_") for name in names)


def test_picks_are_counted_by_policy_and_reason() -> None:
    metrics = RouterMetrics()
    metrics.picked("kv-aware", "prefix")
    metrics.picked("kv-aware", "prefix")
    metrics.picked("kv-aware", "ring")
    value = metrics.registry.get_sample_value
    assert value("kvbridge_router_picks_total", {"policy": "kv-aware", "reason": "prefix"}) == 2.0
    assert value("kvbridge_router_picks_total", {"policy": "kv-aware", "reason": "ring"}) == 1.0
