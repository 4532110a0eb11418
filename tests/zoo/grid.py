"""The grid ``kvbridge plan`` is checked over for each zoo member: TP 1/2/4/8 on each side where the model's KV heads
spread evenly, blocks of 16/32/64 tokens on each side, every layout the spec reaches (cacheKind Split, BlocksFirst
or CrossLayer, each side's kvLayout HND or NHD) and both connectors, vLLM on GPUs.

:func:`verdict_codes` is the plan's check: the compatibility rules and every engine check (``verdict_for``), less the
advice's narrowing, which changes messages and never codes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvbridge_agent.core import CacheKind, KVLayout, RoleSettings
from kvbridge_agent.core.compat import check_pair
from kvbridge_agent.core.model import ModelGeometry
from kvbridge_agent.core.wire import heads_divide
from kvbridge_operator.api.spec import Connector, DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children.verdict import spec_problems, verdict_for

TPS = (1, 2, 4, 8)
BLOCKS = (16, 32, 64)
CONNECTORS = (Connector.KVBRIDGE, Connector.NIXL)


@dataclass(frozen=True)
class Point:
    connector: Connector
    cache_kind: CacheKind
    prefill: RoleSettings
    decode: RoleSettings

    @property
    def words(self) -> str:
        p, d = self.prefill, self.decode
        return (
            f"{self.connector.value} {self.cache_kind.value} TP {p.tensor_parallel_size}->{d.tensor_parallel_size} "
            f"block {p.block_size}->{d.block_size} {p.kv_layout.value}->{d.kv_layout.value}"
        )


def points(model: ModelGeometry) -> Iterator[Point]:
    """Every point of the grid for ``model``."""
    tps = [tp for tp in TPS if heads_divide(model, tp)]
    for connector, kind, p_tp, d_tp, p_block, d_block, p_layout, d_layout in itertools.product(
        CONNECTORS, CacheKind, tps, tps, BLOCKS, BLOCKS, KVLayout, KVLayout
    ):
        prefill = RoleSettings(tensor_parallel_size=p_tp, block_size=p_block, kv_layout=p_layout)
        decode = RoleSettings(tensor_parallel_size=d_tp, block_size=d_block, kv_layout=d_layout)
        yield Point(connector, kind, prefill, decode)


def deployment(model: ModelGeometry) -> DisaggregatedDeployment:
    """A deployment of ``model`` on vLLM (GPUs), every setting the grid moves at its default."""
    block = model.model_dump(by_alias=True, mode="json", exclude_defaults=True)
    return parse_deployment(
        {
            "apiVersion": "kvbridge.io/v1alpha1",
            "kind": "DisaggregatedDeployment",
            "metadata": {"name": "zoo"},
            "spec": {"engine": {"kind": "VLLM"}, "model": {"name": model.name, **block}},
        }
    )


def at(base: DisaggregatedDeployment, point: Point) -> DisaggregatedDeployment:
    spec = base.spec
    changed = spec.model_copy(
        update={
            "engine": spec.engine.model_copy(update={"connector": point.connector}),
            "model": spec.model.model_copy(update={"cache_kind": point.cache_kind}),
            "prefill": spec.prefill.model_copy(update=dict(point.prefill)),
            "decode": spec.decode.model_copy(update=dict(point.decode)),
        }
    )
    return base.model_copy(update={"spec": changed})


def verdict_codes(dd: DisaggregatedDeployment) -> list[str]:
    """The codes of every problem ``kvbridge plan`` reports for ``dd``; empty: compatible."""
    spec = dd.spec
    found = check_pair(spec.model, spec.prefill.settings(), spec.decode.settings(), spec.transfer, suggestions=False)
    found += spec_problems(spec)
    if found:
        return sorted({problem.code for problem in found})
    result = verdict_for(dd)  # the operator's settings and the rendered pods, as plan checks them
    return sorted({problem.code for problem in result}) if isinstance(result, list) else []
