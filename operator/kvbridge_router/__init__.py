"""``kvbridge-router``: an OpenAI-compatible front that sends each request to a prefill pod, then to a decode pod
paired with it, taking both from a DisaggregatedDeployment's status (docs/router.md).

Reading order:
- ``cli``: the ``kvbridge-router`` command (``kvbridge router`` is the same), its flags generated from the settings.
- ``settings``: pure: every setting and its default, written once; the operator renders the router's flags from it.
- ``proxy``: the HTTP front: the two calls, retries, timeouts, streaming.
- ``server``: the HTTP/1.1 server the front's routes run in (llhttp; the head's bounds, keep-alive, pipelining).
- ``admission``: what a request must be before any prefill.
- ``prompts``: pure: a request's prompt, as admission checks it and kv-aware scores it.
- ``samples``: pure: OpenAI's ``n``: the samples' requests, and one answer joined from theirs.
- ``auth``: pure: clients' API keys (``Authorization: Bearer``), compared in constant time.
- ``errors``: the router's errors, in OpenAI's error shape.
- ``pool``: pure: which pods pair, the balancer (what the policies read: loads, what was sent where).
- ``policies``: pure: how pods are chosen, one module per policy behind one protocol (``kv-aware``, ``least-loaded``,
  ``round-robin``); the choice returned as a value.
- ``prefixes``: pure: what was sent to each pod by prompt prefix (the ``kv-aware`` policy).
- ``ring``: pure: consistent hashing with bounded loads, where replicas send a prefix none of them sent yet.
- ``peers``: pure: what replicas report to each other (loads, what each sent where), the frame and the view.
- ``peering``: the reports sent to the other replicas, and theirs received.
- ``source``: the watched status, or a file.
- ``upstream``: the HTTP/1.1 client to the engines.
- ``answers``: whether a decode pod's answer is an answer or an engine's refusal.
- ``metrics``: the router's Prometheus metrics.
- ``tracing``: the router's OpenTelemetry spans, and the trace context each engine call carries.
- ``__main__``: ``python -m kvbridge_router``.

A separate process with its own, read-only RBAC: it imports the operator's ``api``, API client and retry delays,
never Kopf, the children or the controller. ``settings``, ``prompts``, ``samples``, ``pool``, ``policies``,
``prefixes``, ``ring``, ``peers``, ``answers`` and ``auth`` import no HTTP library, event loop or metrics client
(import-linter keeps it so); ``settings`` imports nothing of the operator, whose ``api`` and ``children`` read it;
``server`` and ``upstream``, the two HTTP ends, import nothing of kvbridge.
"""
