"""The DisaggregatedDeployment API.

Reading order:
- ``spec``: the resource's fields and their checks (pydantic, the one source of truth).
- ``status``: the status models and conditions.
- ``names``: every label, annotation, kind and child name.
- ``objects``: a Kubernetes object as JSON, and setting its fields by dotted path.
- ``crd``: the CRDs generated from the models.
- ``rbac``: every permission the operator needs.
"""
