"""The specs behind the pairing keys still running, and whether a prefill of one pairs with a decode of another.

A pod carries only its pairing key (pairing.py). To judge an old prefill pod with a new decode pod, the
operator keeps, in the deployment's annotation ``kvbridge.io/pairing-specs``, the compatibility-relevant
spec of every key that pods still run (the model, engine, transfer settings and both roles' settings; no
templates, replicas or rollout settings), and drops a key when its last pod is gone.

Two keys pair when their model, engine kind/device/connector and transfer settings are equal and the verdict
on "prefill as in the first, decode as in the second" is a plan: the same check as any spec. An unknown key
(written by an older operator) pairs with nothing but itself: blue/green is the safe answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import KVBridgeError, TransferPlan
from kvbridge_operator.api.names import API_VERSION, KIND
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children.verdict import verdict_for

ANNOTATION = "kvbridge.io/pairing-specs"
#: role fields that do not decide compatibility (kept out of the record)
_ROLE_RUNTIME = {"replicas", "minReplicas", "maxReplicas", "rollout", "template"}


def record(dd: DisaggregatedDeployment) -> Obj:
    """The compatibility-relevant spec of a deployment, as JSON."""
    spec = dd.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    for role in ("prefill", "decode"):
        spec[role] = {k: v for k, v in spec[role].items() if k not in _ROLE_RUNTIME}
    return {k: spec[k] for k in ("model", "engine", "transfer", "prefill", "decode")}


def load(text: str | None) -> dict[str, Obj]:
    """The records by pairing key; an unreadable annotation reads as none (then unknown keys go blue/green)."""
    try:
        loaded = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return {str(k): v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}


def dump(records: dict[str, Obj], keep: Iterable[str]) -> str:
    kept = set(keep)
    return json.dumps({k: v for k, v in sorted(records.items()) if k in kept}, sort_keys=True, separators=(",", ":"))


def _engine_identity(engine: Obj) -> tuple[Any, ...]:
    return engine.get("kind"), engine.get("device"), engine.get("connector")


def pairs_with(records: dict[str, Obj], name: str) -> Callable[[str, str], str | None]:
    """``compatible(prefill_key, decode_key)``: ``None`` when they pair, else why not."""
    cache: dict[tuple[str, str], str | None] = {}

    def compatible(prefill_key: str, decode_key: str) -> str | None:
        if prefill_key == decode_key:
            return None  # one checked plan (pairing.py)
        if (prefill_key, decode_key) in cache:
            return cache[(prefill_key, decode_key)]
        cache[(prefill_key, decode_key)] = answer = _judge(records, name, prefill_key, decode_key)
        return answer

    return compatible


def _judge(records: dict[str, Obj], name: str, prefill_key: str, decode_key: str) -> str | None:
    prefill, decode = records.get(prefill_key), records.get(decode_key)
    if prefill is None or decode is None:
        return f"the spec of {prefill_key if prefill is None else decode_key} is not known"
    for part in ("model", "transfer"):
        if prefill.get(part) != decode.get(part):
            return f"spec.{part} differs"
    if _engine_identity(prefill.get("engine") or {}) != _engine_identity(decode.get("engine") or {}):
        return "spec.engine (kind, device or connector) differs"
    mixed = {**decode, "prefill": prefill["prefill"]}
    try:
        verdict = verdict_for(_deployment(name, mixed))
        own = {
            key: verdict_for(_deployment(name, spec)) for key, spec in ((prefill_key, prefill), (decode_key, decode))
        }
    except KVBridgeError as exc:
        return exc.message
    if not isinstance(verdict, TransferPlan):
        return "; ".join(f"{p.code} at {p.field}" for p in verdict)
    # each running pod was planned with its own spec's peer settings: the prefill pod offers blocks in its plan's
    # wire format, the decode pod reads in its own; a mixed pair works only where both are the mixed plan's
    for key, plan in own.items():
        if not isinstance(plan, TransferPlan) or plan.wire != verdict.wire:
            offered = plan.wire.block_size if isinstance(plan, TransferPlan) else "?"
            return (
                f"the pods of {key} were planned with {offered}-token wire blocks, a mixed pair needs "
                f"{verdict.wire.block_size}: they would refuse each other (WIRE_FORMAT_MISMATCH)"
            )
    return None


def _deployment(name: str, spec: Obj) -> DisaggregatedDeployment:
    return parse_deployment({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec})


@dataclass(frozen=True)
class Memory:
    """What the deployment remembers of the specs its pods run."""

    pairs_with: Callable[[str, str], str | None]  # the verdict between two pairing keys (None: compatible)
    annotation: str | None  # the annotation's new value, when it changes


def remember(dd: DisaggregatedDeployment, key: str, text: str | None, present: Iterable[str]) -> Memory:
    """The records of the annotation ``text`` with the current spec's (``key``) added, judged for pairing; and what
    the annotation keeps: the records of the keys still ``present`` (the pods' and the current one)."""
    records = {**load(text), key: record(dd)}
    kept = dump(records, present)
    return Memory(pairs_with(records, dd.metadata.name), kept if kept != text else None)
