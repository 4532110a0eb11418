"""kvbridge operator: the DisaggregatedDeployment controller and the ``kvbridge`` command.

Layers, each importing only those below it (import-linter keeps it so):

* ``api`` — the resource: ``spec`` (the pydantic models, the one source of truth), ``status``, ``crd`` (the CRDs
  generated from them), ``rbac``, ``names`` (labels, kinds, child names), ``objects``.
* ``children`` — pure: the ``verdict`` (compatibility before scheduling), its ``remedy``, and the children a spec
  renders (``render``, ``vllm_engine``, ``multinode``, ``placement``, ``serving``, ``scaling``, ``model_source``,
  ``pairing``, ``keys``).
* ``controller`` — ``handlers`` (Kopf) call ``reconcile``: read, then ``plan`` (pure: every action, the status in
  ``observe``, the ``rollout`` step), then ``apply``.
* ``cli`` — ``kvbridge plan|model|crd|operator|router|demo``.

Below every layer: ``kube`` (the API client), ``backoff`` (retry delays), ``config`` (settings). Imports only the
agent's pure core (``kvbridge_agent.core``).
"""

__version__ = "0.1.0"
