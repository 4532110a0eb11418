"""A prefill engine's leases, in the engine itself: a heartbeat renews a lease only while it runs, and says so."""

from __future__ import annotations

import time

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.synthetic.engine import Engine, _Held


def test_a_heartbeat_renews_only_running_leases_and_names_them() -> None:
    engine = Engine(
        EngineEnvironment(
            role=Role.PREFILL,
            engine_id="p",
            model=ModelGeometry(name="m", num_layers=1, num_kv_heads=1, head_dim=8),
            prefill=RoleSettings(),
            decode=RoleSettings(),
        )
    )
    now = time.monotonic()
    engine._held.update(running=_Held([1], now + 5), ended=_Held([2], now - 0.01))  # ended: not yet freed
    assert engine.heartbeat(["running", "ended", "unknown"]) == ["running"]
    assert engine._held["ended"].deadline < time.monotonic()  # freed by the lease thread, never revived
