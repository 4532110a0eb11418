"""The router's policies: how it chooses a prefill pod and a decode pod for a request (docs/router.md, "Policies").

Reading order:
- ``base``: pure: the :class:`Policy` protocol, the :class:`Choice` it returns (the pair and why), the reading of a
  set of candidates every policy shares.
- ``least_loaded``: pure: the fewest requests in flight, ties in turns.
- ``kv_aware``: pure: the pod that was sent the longest leading part of the prompt, unless much busier; new prefixes
  on the hash ring (the default).
- ``round_robin``: pure: the next pod in turn, whatever its load.

Adding a policy: its value in ``RouterPolicy`` (the operator's ``api.router_settings``; the flag and
``spec.router.policy`` take it from there), one module here, and its line in :data:`POLICIES`.
"""

from __future__ import annotations

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.policies.base import Choice, Policy
from kvbridge_router.policies.kv_aware import KvAware
from kvbridge_router.policies.least_loaded import LeastLoaded
from kvbridge_router.policies.round_robin import RoundRobin

#: every policy, by its name (each is stateless: what it reads is the Balancer it is given)
POLICIES: dict[RouterPolicy, Policy] = {
    RouterPolicy.KV_AWARE: KvAware(),
    RouterPolicy.LEAST_LOADED: LeastLoaded(),
    RouterPolicy.ROUND_ROBIN: RoundRobin(),
}

__all__ = ["POLICIES", "Choice", "Policy"]
