"""The controller: Kopf ``handlers`` call one ``reconcile`` for every event.

Reading order:
- ``handlers``: the Kopf handlers, thin: one lock per resource, then ``reconcile``.
- ``reconcile``: read the children, decide, apply.
- ``decide``: pure: every action a reconcile takes, from what it read.
- ``actions``: those actions as values.
- ``apply``: carries them out.
- ``rollout``: pure: the step of each workload.
- ``optional``: pure: router, InferencePool, PodGroup.
- ``observe``: pure: the whole status and its events.
- ``status_rules``: pure: the conditions and events, a table of small rules.
- ``revisions``: the pairing keys of the specs pods still run.
- ``autoscaling``: kvbridge's planner (spec.autoscaling): a pass that sizes both roles from Prometheus.
- ``metrics``: the operator's own.
"""
