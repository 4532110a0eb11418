"""One idempotent reconcile for every path (create, update, resume, resync, pod events): read, decide, apply.

Reads: none for the children when the operator's watches serve them (``cached``: handlers.py, whose only read is
the deployment's, afresh); without them :func:`read_children` makes seven, a get of each role's DisaggregatedRole,
StatefulSet and LeaderWorkerSet and one list of the deployment's pods. Applying reads once more per
DisaggregatedRole whose replicas the spec changed, or whose create found it there (apply.py's fresh read before it
writes its replicas).

:func:`decide.decide` computes, purely, every action the reconcile takes — children applied with server-side apply
under kvbridge's field manager (the Secret created once and never patched), children deleted, the status,
annotations and events — and :func:`apply.execute` carries them out. An incompatible spec changes nothing that
runs. A pod event changes no spec, so it applies only the workloads the rollout's step moves and writes the status
(``apply_children=False``); the periodic resync applies every child.

Where the API turns out not to serve an optional kind (a CRD not installed: LeaderWorkerSet, InferencePool,
HTTPRoute, PodGroup), the decision is made again knowing it; what was already done is not done twice, except a
Secret's create: the decision made again renders a fresh key, so the create is sent again, answered 409, and the Secret
created first is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import LABEL_DEPLOYMENT, role_name
from kvbridge_operator.api.objects import Obj, now_rfc3339
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.actions import Action
from kvbridge_operator.controller.apply import KindMissingError, execute
from kvbridge_operator.controller.decide import ExistingChildren, Observed, decide
from kvbridge_operator.kube import LEADER_WORKER_SETS, PODS, ROLES, STATEFUL_SETS, KubeClient

#: every optional kind at most once, and once more with all of them known
MAX_DECISIONS = 6


@dataclass(frozen=True)
class Outcome:
    applied: bool  # the spec's children were written (False: invalid or incompatible: nothing that runs changed)


async def read_children(client: KubeClient, namespace: str, name: str) -> ExistingChildren:
    """From the API, in the reads the module's docstring counts (the operator's own watches serve them instead:
    handlers.py)."""
    roles = {role: await client.get(ROLES, namespace, role_name(name, role)) for role in Role}
    stateful_sets = {role: await client.get(STATEFUL_SETS, namespace, role_name(name, role)) for role in Role}
    # without the LeaderWorkerSet CRD the API answers 404, which get reads as none
    groups = {role: await client.get(LEADER_WORKER_SETS, namespace, role_name(name, role)) for role in Role}
    pods = await client.list(PODS, namespace, f"{LABEL_DEPLOYMENT}={name}")
    return ExistingChildren(roles, stateful_sets, pods, groups)


async def reconcile(
    client: KubeClient,
    body: Obj,
    config: OperatorConfig,
    apply_children: bool = True,
    cached: ExistingChildren | None = None,
) -> Outcome:
    """One reconcile; ``cached`` children (from the operator's watch indexes) spare their reads."""
    meta = body["metadata"]
    seen = cached or await read_children(client, meta.get("namespace") or "default", meta["name"])
    observed = Observed(body, seen, config, apply_children, now_rfc3339())
    done: list[Action] = []
    for _ in range(MAX_DECISIONS):
        actions = decide(observed)
        try:
            await execute(client, actions.actions, done)
        except KindMissingError as exc:
            if exc.kind in observed.missing:
                raise
            observed = Observed(body, seen, config, apply_children, observed.now, observed.missing | {exc.kind})
            continue
        return Outcome(actions.applied)
    raise RuntimeError(f"the reconcile of {meta['name']} decided {MAX_DECISIONS} times")  # unreachable: kinds are few
