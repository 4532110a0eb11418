"""The emulated cluster: everything ``kvbridge demo``, the tests and the benchmarks run on instead of Kubernetes.

Reading order:
- ``apiserver``: kmock's emulator made realistic: uids, generations, watches, subresources.
- ``kinds``: the kinds it serves before any CRD, their discovery, and the Scale subresource.
- ``watches``: its watches, subscribed before the snapshot, streamed as Kubernetes does.
- ``local_api``: the emulator on a local port with the CRDs, and stopping an operator beside it.
- ``field_managers``: its server-side apply and ``managedFields``.
- ``patches``: its JSON, merge and strategic merge patches, and what a PATCH or PUT makes of an object.
- ``deletion``: its DELETE options, and the garbage collector's part (dependents deleted or orphaned).
- ``api_errors``: its refusals, worded as Kubernetes words them.
- ``selectors``: merge patches, label and field selectors.
- ``openapi``: OpenAPI v3 and strict field validation, for ``kubectl``.
- ``tables``: server-side ``Table`` output, for ``kubectl get``.
- ``runner``: a local stand-in for the StatefulSet controller and kubelet.
- ``pods``: a pod's engine container as a local process.
- ``pod_logs``: ``kubectl logs``: a pod's container log as the local kubelet keeps it.
- ``tiny_model``: a random-weight model and tokenizer made locally.
- ``pd_requests``: prefill-then-decode calls, and the single-engine baseline.
- ``demo``: ``kvbridge demo``: the manifests, the local cluster, the run.
- ``demo_preflight``: what the local cluster can run, a manifest refused before anything starts.
- ``demo_wait``: waiting for the verdicts, a crash-looping pod reported as it happens.
- ``demo_traffic``: the demo's requests through the router, and the prefill restart halfway.
- ``demo_report``: the demo's report, as JSON or text.
- ``serve``: ``kvbridge demo --serve``: the local cluster stays up.
- ``cli``: the commands the simulation adds to ``kvbridge``.
- ``cluster``: for tests and benchmarks: the operator in-process on the emulator.
- ``kubectl``: for tests: the real ``kubectl`` against the emulated cluster.
- ``vllm_engines``: for tests and benchmarks: real vLLM engines started from rendered pod templates.
- ``local_prometheus``: for tests and benchmarks: a real Prometheus scraping the local cluster's pods.
- ``load_ramp``: for tests and benchmarks: an open-loop load at a stepped rate, and what it came to.
- ``planner_loop``: for tests and benchmarks: the planner's loop closed on the local cluster under a load ramp.
- ``images``: for ``make images`` and tests: the project's container images built and run without a Docker engine.
- ``support``: free ports and waiting for a condition with a deadline, for the demo, tests and benchmarks.
- ``trace_timeline``: for docs: one request's trace (spans an OTLP receiver decoded) drawn as a timeline.

Never imported by a product package (import-linter); no image contains it. Needs the ``demo`` extra (kmock).
"""
