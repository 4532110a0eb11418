"""The DisaggregatedDeployment API.

Reading order:
- ``spec``: the resource's fields and their checks (pydantic, the one source of truth), and parsing a manifest.
- ``field_errors``: a refused manifest's errors in its words: a misspelt field with the one meant and those allowed.
- ``images``: engine images: which cannot carry kvbridge's connector (vLLM's own), kvbridge's engine image.
- ``transfer``: ``spec.transfer``: the transfer settings and the KV data path's network.
- ``autoscaling``: ``spec.scaling`` and ``spec.autoscaling``: the ratio of the roles and the planner.
- ``serving``: ``spec.router`` and ``spec.inferencePool``.
- ``router_settings``: pure: the router's settings and their defaults, written once: ``spec.router``'s defaults,
  the flags the operator renders and those ``kvbridge-router`` parses (the router imports them, never the reverse).
- ``placement``: ``spec.placement``: node fit and gang scheduling.
- ``tracing``: ``spec.tracing``: OpenTelemetry traces.
- ``status``: the status models and conditions.
- ``names``: every label, annotation, kind and child name.
- ``objects``: a Kubernetes object as JSON, and setting its fields by dotted path.
- ``crd``: the CRDs generated from the models.
- ``rbac``: every permission the operator needs.
"""
