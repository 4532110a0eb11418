"""kvbridge operator: the DisaggregatedDeployment controller and the ``kvbridge`` command.

Reading order:
- ``api``: the resource: its spec (the one source of truth), status, names, CRDs and RBAC.
- ``children``: pure: the verdict on a spec (compatibility before scheduling) and the children it renders.
- ``planner``: kvbridge's planner (spec.autoscaling): both roles sized to TTFT and ITL targets from Prometheus.
- ``controller``: Kopf handlers and the one reconcile: read, decide every action (pure), apply; the planner's pass.
- ``cli``: ``kvbridge plan|model|crd|profile|operator|demo``.
- ``kube``: the Kubernetes API client.
- ``backoff``: retry delays after API errors.
- ``config``: the operator's settings.
- ``__main__``: ``python -m kvbridge_operator``.

Layers, each importing only those below it (import-linter keeps it so): ``cli``, ``controller``, ``planner``,
``children``, ``api``; ``kube``, ``backoff`` and ``config`` sit below every layer. Imports only the agent's pure core
(``kvbridge_agent.core``), and nothing of the router (``kvbridge_router``, which imports ``api``, ``kube`` and
``backoff``; the router's settings are ``api.router_settings``).
"""

__version__ = "0.1.0"
