"""kvbridge's planner (``spec.autoscaling``): prefill and decode sized to TTFT and ITL targets (docs/autoscaling.md).

Reading order:
- ``profile``: pure: what one engine of each role can do (a performance profile, from a ConfigMap).
- ``buckets``: pure: what a percentile read from histogram buckets says, compared alike with a prediction.
- ``hysteresis``: pure: what keeps a role's size from oscillating (tolerance, stabilization, reversal window,
  warm-up).
- ``sizing``: pure: observed traffic and the profile -> both roles' sizes, with the safety rules.
- ``prometheus``: the traffic, read from a Prometheus server's HTTP API.

The operator's controller (``controller.autoscaling``) runs a pass per deployment and writes the roles' /scale.
"""
