"""The emulated cluster: everything ``kvbridge demo``, the tests and the benchmarks run on instead of Kubernetes.

Reading order: ``apiserver`` (kmock's emulator made realistic: uids, generations, watches, selectors, server-side
apply with ``field_managers``, subresources; ``emulated_api`` starts it with the CRDs), ``runner`` and ``pods`` (a
local stand-in for the StatefulSet controller and kubelet that runs each pod's command as a process), ``tiny_model``
(a random-weight model and tokenizer made locally), ``pd_requests`` (prefill-then-decode calls), ``demo`` and ``cli``
(``kvbridge demo``), and the helpers tests and benchmarks share: ``cluster`` (the operator in-process on the
emulator, with a stand-in StatefulSet/LWS controller) and ``vllm_engines`` (real vLLM engines started from rendered
pod templates).

Never imported by a product package (import-linter); no image contains it. Needs the ``demo`` extra (kmock).
"""
