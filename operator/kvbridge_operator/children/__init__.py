"""Pure functions from a spec to a verdict and to the objects the operator writes.

Reading order:
- ``verdict``: is the spec compatible: the agent core's rules, the engine kind's, placement's, multi-node's.
- ``remedy``: a checked fix when it is not.
- ``objects``: the child kinds (workloads, pod templates, Services, NetworkPolicy, PDBs, the router, the
  InferencePool, the PodGroup), one module each, and the tables of them.
- ``engines``: the engine kinds (vLLM, the synthetic engine), one module each behind one interface.
- ``multinode``: LeaderWorkerSets, for engines that span nodes.
- ``templates``: what a role's ``template`` overlay may change, checked as written.
- ``template_changes``: what the overlay changed of the rendered pod, found by rendering it with and without.
- ``placement``: where pods may run: what fits a node, what stays together.
- ``network``: the KV data path's network (UCX, RDMA), checked and rendered.
- ``ports``: the side channel's ports kept clear of those the engine pods listen on.
- ``termination``: how an engine pod ends without losing a request.
- ``scaling``: DisaggregatedRoles and how many engines each role runs.
- ``model_source``: where an engine's weights come from.
- ``pairing``: which pods may pair.
- ``keys``: the side channel's CURVE keys.
- ``transfer_token``: the router's token, mounted where ``spec.router.signTransfers`` wants it.
- ``peer_key``: the key router replicas sign their reports to each other with.
- ``tracing``: ``spec.tracing`` as OpenTelemetry's environment and vLLM's flag.
"""
