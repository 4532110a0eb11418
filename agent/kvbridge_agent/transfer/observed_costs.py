"""The staged-read cost model corrected by the reads a decode rank completes (docs/protocol.md §4d).

The constants ``transfer.cost_model`` measures at start are a few milliseconds of one moment: a machine loaded then
(or later) makes them wrong for every request after. Each completed read the model weighed is an observation of the
path it took: its seconds from start to every byte in place, against the model's estimate of that path.
:class:`Correction` keeps, per path (``direct``, ``staged``), an exponentially weighted estimate of that ratio, and
:class:`ObservedCosts` scales the model's estimates by it before choosing.

Bounds, so that one outlier cannot flip every decision:

- the estimate is kept as a logarithm; a sample is first clipped to within :data:`STEP` of the current estimate, so
  one sample moves it by at most a factor ``STEP ** WEIGHT`` (1.07 with the defaults);
- the estimate stays within ``[1 / CEILING, CEILING]`` of the measured model, whatever the samples;
- at a steady ratio ``r`` inside those bounds it converges geometrically: the log error shrinks by ``1 - WEIGHT`` per
  sample once within ``STEP``, and before that it closes by ``WEIGHT * log(STEP)`` per sample.

Exploration: the path the model does not pick gets no samples, so its estimate could stay wrong forever. Every
:data:`EXPLORE_EVERY`-th weighed request, when one path has not been taken in the last :data:`EXPLORE_EVERY`, takes
that path, unless its corrected estimate is more than :data:`EXPLORE_LIMIT` times the other's (a probe must not
cost much).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvbridge_agent.core.staging import INTO_BLOCKS, Choice

#: weight of the newest sample in the logarithm of a correction
WEIGHT = 0.1
#: a sample counts at most this factor above or below the current estimate
STEP = 2.0
#: a correction stays within this factor of the measured model
CEILING = 16.0
#: a path not taken in this many weighed requests is tried on the next one (0: never)
EXPLORE_EVERY = 32
#: ... unless its estimate is more than this many times the chosen path's
EXPLORE_LIMIT = 4.0
DIRECT = "direct"
STAGED = "staged"


@dataclass
class Correction:
    """A bounded, exponentially weighted estimate of observed / estimated seconds for one path."""

    log_scale: float = 0.0
    samples: int = 0
    weight: float = WEIGHT
    step: float = STEP
    ceiling: float = CEILING

    @property
    def scale(self) -> float:
        return math.exp(self.log_scale)

    def observe(self, estimated: float, observed: float) -> None:
        """One completed read: the model's ``estimated`` seconds for the path it took, and the ``observed`` ones
        (non-positive or non-finite values are ignored)."""
        if not (estimated > 0 and observed > 0 and math.isfinite(estimated) and math.isfinite(observed)):
            return
        bound = math.log(self.step)
        sample = min(max(math.log(observed) - math.log(estimated), self.log_scale - bound), self.log_scale + bound)
        limit = math.log(self.ceiling)
        updated = (1 - self.weight) * self.log_scale + self.weight * sample
        self.log_scale = min(max(updated, -limit), limit)
        self.samples += 1


@dataclass
class ObservedCosts:
    """Per path corrections of one decode rank's cost model, and when each path was last taken."""

    direct: Correction = field(default_factory=Correction)
    staged: Correction = field(default_factory=Correction)
    explore_every: int = EXPLORE_EVERY
    weighed: int = 0  # requests weighed
    last: dict[str, int] = field(default_factory=dict)  # path -> the weighed request that last took it
    explored: int = 0  # requests sent down the other path to keep its estimate fresh
    #: the model's uncorrected estimates of the last request weighed (what its completed read is compared with)
    estimates: Choice | None = None

    def choose(self, choice: Choice, margin: float) -> Choice:
        """The model's ``choice`` with its estimates corrected (``staged`` where the corrected staged estimate is
        below ``margin`` times the direct one), or the path left untried too long where that probe is not too
        dear."""
        self.weighed += 1
        self.estimates = choice
        direct = choice.direct_seconds * self.direct.scale
        blocks, buffer = choice.blocks_seconds * self.staged.scale, choice.buffer_seconds * self.staged.scale
        corrected = replace(choice, direct_seconds=direct, blocks_seconds=blocks, buffer_seconds=buffer)
        staged = corrected.staged_seconds < margin * direct
        taken, other = (STAGED, DIRECT) if staged else (DIRECT, STAGED)
        taken_cost, other_cost = (corrected.staged_seconds, direct) if staged else (direct, corrected.staged_seconds)
        stale = self.explore_every > 0 and self.weighed - self.last.get(other, 0) > self.explore_every
        if stale and other_cost <= EXPLORE_LIMIT * taken_cost:
            staged, taken = not staged, other
            self.explored += 1
        self.last[taken] = self.weighed
        return replace(corrected, staged=staged)

    def expected(self, into: str | None = None) -> tuple[str, float] | None:
        """The last weighed request's path (staged ``into`` blocks or buffer, or direct: ``None``) and the model's
        uncorrected estimate of it (``InFlight.expected``)."""
        found = self.estimates
        if found is None:
            return None
        if into is None:
            return DIRECT, found.direct_seconds
        return STAGED, found.blocks_seconds if into == INTO_BLOCKS else found.buffer_seconds

    def observe(self, path: str, estimated: float, observed: float) -> None:
        """A read the model weighed completed down ``path`` in ``observed`` seconds; ``estimated``: the model's
        uncorrected estimate of that path."""
        (self.staged if path == STAGED else self.direct).observe(estimated, observed)

    def to_dict(self) -> dict[str, float]:
        return {
            "directScale": round(self.direct.scale, 3),
            "stagedScale": round(self.staged.scale, 3),
            "directSamples": self.direct.samples,
            "stagedSamples": self.staged.samples,
            "explored": self.explored,
        }
