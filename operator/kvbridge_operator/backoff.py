"""Retry delays after API errors: capped exponential backoff with jitter.

Kopf's defaults retry a failed handler after 60 s and its own API calls on a Fibonacci schedule (1, 1, 2, 3,
5, 8, 13, 21 s), so an operator converged up to a minute after the API server healed, and operators that all
saw the same outage retried in lockstep. Here every delay doubles from ``base`` up to ``cap`` and is drawn
uniformly from its upper half, so retries spread out and never wait longer than ``cap`` once the API is back.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    base: float = 0.5
    cap: float = 4.0
    #: how many delays an iteration yields (Kopf gives up on a call when they run out)
    attempts: int = 100
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def delay(self, attempt: int) -> float:
        """The delay before retry number ``attempt`` (0 for the first retry)."""
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt, 32))
        return ceiling * self.rng.uniform(0.5, 1.0)

    def __iter__(self) -> Iterator[float]:
        return (self.delay(attempt) for attempt in range(self.attempts))


#: the operator's policy for handler retries and Kopf's own API calls
OPERATOR_BACKOFF = Backoff()
