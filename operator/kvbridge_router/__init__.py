"""``kvbridge router``: an OpenAI-compatible front that sends each request to a prefill pod, then to a decode
pod paired with it, taking both from a DisaggregatedDeployment's status (docs/router.md).

``pool`` (pure: pairs and balancing), ``proxy`` (the HTTP front), ``source`` (the watched status, or a file),
``metrics``. The router imports neither Kopf nor the operator's reconcile: it is a separate process with its
own, read-only, RBAC.
"""
