"""The DisaggregatedDeployment API: read ``spec`` first (the resource's fields and their checks), then ``status``,
``names`` (every label, annotation, kind and child name), ``crd`` (the CRDs generated from the models) and ``rbac``.
"""
