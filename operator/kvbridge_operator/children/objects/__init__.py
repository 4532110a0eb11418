"""The children a compatible spec renders, one module per child kind, and the tables of them.

Reading order:
- ``desired``: the tables of child kinds, and every child a spec renders from them.
- ``shared``: what every kind's renderer shares: owner reference, metadata, selector, overlay, revision.
- ``pod``: a role's pod template (the engine kind's containers, the agent's environment, the overlay).
- ``workload``: the StatefulSet or LeaderWorkerSet that runs a role's engines.
- ``service``: a role's headless Service.
- ``network_policy``: the NetworkPolicy fencing the engine pods.
- ``disruption_budget``: a role's PodDisruptionBudget.
- ``secret``: the side channel's key pair, created once.
- ``router``: kvbridge's router: Deployment, Services, PDB, RBAC (``spec.router``).
- ``inference_pool``: the InferencePool and its HTTPRoute (``spec.inferencePool``).
- ``pod_group``: the gang's PodGroup (``spec.placement.gang``).
"""
