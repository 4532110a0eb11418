"""Pure functions from a spec to a verdict and to the objects the operator writes.

Reading order: ``verdict`` (is the spec compatible: the agent core's rules, vLLM's, placement's, multi-node's),
``remedy`` (a checked fix when it is not), ``render`` (Services, NetworkPolicy, PDBs, the workloads and their pod
templates) with ``vllm_engine`` (the ``vllm serve`` containers) and ``multinode`` (LeaderWorkerSets), then
``placement``, ``serving`` (router, InferencePool), ``scaling`` (DisaggregatedRoles), ``model_source``, ``pairing``
(which pods may pair), ``keys`` (the side channel's CURVE keys), ``transfer_token`` (the router's token, mounted
where ``spec.router.signTransfers`` wants it).
"""
