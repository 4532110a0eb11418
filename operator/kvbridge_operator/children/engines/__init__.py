"""Engine kinds behind one interface: one module per kind, registered in :data:`ENGINES`.

Reading order:
- ``kind``: what every engine kind answers (:class:`~.kind.EngineKindModule`), and what kinds share.
- ``vllm``: vLLM (``engine.kind: VLLM``): its problems, pod, ports, health, metrics and words.
- ``vllm_serve``: ``vllm serve``'s arguments and environment for one role.
- ``vllm_problems``: what vLLM cannot run of a spec, and what it runs other than asked.
- ``vllm_messages``: the words of ``vllm_problems``' problems, one template each.
- ``vllm_models``: what kvbridge's connector cannot move of a model's KV cache as vLLM groups it.
- ``vllm_cpu``: vLLM's CPU build: the core-binding launcher, CPU attention's sizes.
- ``synthetic``: the synthetic engine (``engine.kind: Synthetic``), kvbridge's own worker that serves no model.

Everything else asks :func:`engine_of` rather than comparing ``spec.engine.kind`` (the API, below this package,
names the kinds that load a KV connector: ``CONNECTOR_KINDS``). To add a kind: a value of ``EngineKind``
(api/spec.py), a module here providing every member of ``EngineKindModule``, and its row in :data:`ENGINES`
(docs/development.md, "Adding an engine kind").
"""

from __future__ import annotations

from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec, EngineKind
from kvbridge_operator.children.engines import synthetic, vllm
from kvbridge_operator.children.engines.kind import EngineKindModule, ServedEngine

#: every engine kind the CRD offers, and the module that answers for it
ENGINES: dict[EngineKind, EngineKindModule] = {
    EngineKind.VLLM: vllm,
    EngineKind.SYNTHETIC: synthetic,
}


def engine_of(spec: DisaggregatedDeploymentSpec) -> EngineKindModule:
    """The module that answers for the spec's engine kind."""
    return ENGINES[spec.engine.kind]


__all__ = ["ENGINES", "EngineKindModule", "ServedEngine", "engine_of"]
