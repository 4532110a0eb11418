"""The controller: Kopf ``handlers`` call one ``reconcile`` for every event.

Reading order: ``reconcile`` (read the children, plan, apply), ``plan`` (pure: every action a reconcile takes, from
what it read), ``actions`` (those actions as values), ``apply`` (carries them out), then the pure parts ``plan``
uses: ``rollout`` (the step of each workload), ``optional`` (router, InferencePool, PodGroup), ``observe`` (the
whole status and its events), ``revisions`` (the pairing keys of the specs pods still run). ``metrics`` are the
operator's own.
"""
