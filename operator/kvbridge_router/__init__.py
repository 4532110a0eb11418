"""``kvbridge router``: an OpenAI-compatible front that sends each request to a prefill pod, then to a decode
pod paired with it, taking both from a DisaggregatedDeployment's status (docs/router.md).

Reading order: ``proxy`` (the HTTP front: the two calls, retries, timeouts, streaming), ``pool`` (pure: which pods
pair, balancing), ``source`` (the watched status, or a file), ``metrics``. A separate process with its own,
read-only RBAC: it imports the operator's ``api``, API client and retry delays, never Kopf, the children or the
controller.
"""
