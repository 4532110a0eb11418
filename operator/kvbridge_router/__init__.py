"""``kvbridge-router``: an OpenAI-compatible front that sends each request to a prefill pod, then to a decode pod
paired with it, taking both from a DisaggregatedDeployment's status (docs/router.md).

Reading order:
- ``cli``: the ``kvbridge-router`` command, its flags generated from the settings (the operator's
  ``api.router_settings``, which it renders the router's flags from).
- ``proxy``: the router: its pool, its routes (the read-only ones here), served on a port.
- ``config``: what a router runs with: the settings as the proxy uses them, and the bounds that are not flags.
- ``generation``: a generation request: admitted, prefilled, decoded, decode retried on another pair; ``n`` samples.
- ``prefill``: the prefill call: the policy's choice (and why, on the trace and in the metrics), retries, its answer.
- ``decode``: the decode call: the transfer parameters added, the answer whole or streamed, a stream broken off.
- ``engines``: what the two calls share: the pool, the balancer, the clients, a 5xx judged, a request's account.
- ``encoding``: the JSON sent to the engines (a field added to the client's own bytes).
- ``server``: the HTTP/1.1 server the routes run in (llhttp; the head's bounds, keep-alive, pipelining).
- ``connection``: one client connection of the server: parsing, requests served in turn, its bounds.
- ``request``: a request as a route's handler reads it: head, and body as it arrives.
- ``response``: what a handler answers, whole or streamed, and how its head is written.
- ``admission``: what a request must be before any prefill.
- ``prompts``: pure: a request's prompt, as admission checks it and kv-aware scores it.
- ``samples``: pure: OpenAI's ``n``: the samples' requests, and one answer joined from theirs.
- ``auth``: pure: clients' API keys (``Authorization: Bearer``), compared in constant time.
- ``errors``: the router's errors, in OpenAI's error shape, the pods they are about in headers.
- ``refusals``: pure: an engine's error answer as the client gets it (OpenAI's error object, bounded).
- ``pool``: pure: which pods pair, the balancer (what the policies read: loads, what was sent where).
- ``policies``: pure: how pods are chosen, one module per policy behind one protocol (``kv-aware``, ``least-loaded``,
  ``round-robin``); the choice returned as a value, the pair and why.
- ``prefixes``: pure: what was sent to each pod by prompt prefix (the ``kv-aware`` policy).
- ``ring``: pure: consistent hashing with bounded loads, where replicas send a prefix none of them sent yet.
- ``peers``: pure: what replicas report to each other (loads, what each sent where), the frame and the view.
- ``peering``: the reports sent to the other replicas, and theirs received.
- ``source``: the watched status, or a file.
- ``upstream``: the HTTP/1.1 client to the engines.
- ``answers``: whether a decode pod's answer is an answer or an engine's refusal.
- ``warmth``: pure: which pods are still cold for a kind of request (their first call of it gets ``cold_timeout``).
- ``metrics``: the router's Prometheus metrics, one table of their definitions.
- ``tracing``: the router's OpenTelemetry spans, and the trace context each engine call carries.
- ``__main__``: ``python -m kvbridge_router``.

A separate process with its own, read-only RBAC: it imports the operator's ``api`` (its settings among them), API
client and retry delays, never Kopf, the children or the controller; the operator imports nothing of it.
``prompts``, ``samples``, ``pool``, ``policies``, ``prefixes``, ``ring``, ``peers``, ``answers``, ``refusals``,
``warmth`` and ``auth`` import no HTTP library, event loop or metrics client (import-linter keeps it so); ``server``,
``connection``, ``request``, ``response`` and ``upstream``, the two HTTP ends, import nothing else of kvbridge.
"""
