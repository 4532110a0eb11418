"""The emulated cluster: everything ``kvbridge demo``, the tests and the benchmarks run on instead of Kubernetes.

Reading order:
- ``apiserver``: kmock's emulator made realistic: uids, generations, watches, subresources.
- ``kinds``: the kinds it serves before any CRD, their discovery, and the Scale subresource.
- ``watches``: its watches, subscribed before the snapshot, streamed as Kubernetes does.
- ``local_api``: the emulator on a local port with the CRDs, and stopping an operator beside it.
- ``field_managers``: its server-side apply and ``managedFields``.
- ``selectors``: merge patches, label and field selectors.
- ``openapi``: OpenAPI v3 and strict field validation, for ``kubectl``.
- ``tables``: server-side ``Table`` output, for ``kubectl get``.
- ``runner``: a local stand-in for the StatefulSet controller and kubelet.
- ``pods``: a pod's engine container as a local process.
- ``pod_logs``: ``kubectl logs``: a pod's container log as the local kubelet keeps it.
- ``tiny_model``: a random-weight model and tokenizer made locally.
- ``pd_requests``: prefill-then-decode calls, and the single-engine baseline.
- ``demo``: ``kvbridge demo``.
- ``serve``: ``kvbridge demo --serve``: the local cluster stays up.
- ``cli``: the commands the simulation adds to ``kvbridge``.
- ``cluster``: for tests and benchmarks: the operator in-process on the emulator.
- ``kubectl``: for tests: the real ``kubectl`` against the emulated cluster.
- ``vllm_engines``: for tests and benchmarks: real vLLM engines started from rendered pod templates.
- ``support``: free ports and waiting for a condition with a deadline, for the demo, tests and benchmarks.
- ``trace_timeline``: for docs: one request's trace (spans an OTLP receiver decoded) drawn as a timeline.

Never imported by a product package (import-linter); no image contains it. Needs the ``demo`` extra (kmock).
"""
