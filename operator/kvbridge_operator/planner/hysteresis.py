"""What keeps a role's size from oscillating: from one pass's recommendations to the size asked for.

The sizing (planner.sizing) turns each pass's observation into a number of engines a role needs, a fraction; on
its own that number follows the noise of a short window (a Poisson count of requests; latencies a loaded machine
delays) across the integers, and a size that follows it goes up and down while the load does not. As Kubernetes'
HPA and Dynamo's planner do, the size asked for moves only when the evidence says so (``spec.autoscaling``'s
settings, docs/autoscaling.md):

- **tolerance** (``tolerancePercent``): a scale-down goes only to a size that carries the need with this much to
  spare (HPA's 10 % tolerance), at the profile's speed or slower (a correction that says the engines are faster
  than profiled, learnt at low utilisation, may lower what a scale-up asks for, never what a scale-down leaves); a
  scale-up goes to the size the need asks for;
- **scale-down stabilization** (``stabilizationWindowSeconds``): a role is scaled down only to the largest size
  recommended within the window (HPA's ``scaleDown.stabilizationWindowSeconds``); scale-ups act at once;
- **reversal window** (``reversalWindowSeconds``): within it of a role's last scale-down, a scale-up is made only
  when the demand's lower bound (the rate seen less twice its Poisson deviation, not extrapolated, at the lower of
  the last two corrections) needs more engines than run, not on chance (a scale-down after a scale-up already waits
  for the stabilization window: the scale-up's own recommendation is in it);
- **warm-up** (``warmupSeconds``): a role's latencies do not refine its profile while its pods are not all ready,
  nor until ``windowSeconds + warmupSeconds`` after its size changed (the window then holds no sample of the old
  size, and new engines' first requests are behind them) — see :func:`warm`.

Pure: no I/O; every function returns a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

UP = 1
DOWN = -1


@dataclass(frozen=True, slots=True)
class Hysteresis:
    """The settings (``spec.autoscaling``); the defaults here act as none, the CRD's defaults are in api.autoscaling."""

    #: the spare a scale-down leaves, a fraction of the need (0.1: a size that carries 110 % of it)
    tolerance: float = 0.0
    #: seconds after a role's scale-down within which a scale-up needs the demand's lower bound
    reversal_seconds: float = 0.0
    #: seconds after a role's change (beyond the metrics' window) before its latencies refine its profile again
    warmup_seconds: float = 0.0


#: settings that add nothing to the scale-down stabilization (the planner before them)
NONE = Hysteresis()


@dataclass(frozen=True, slots=True)
class Change:
    """A role's last change of size: when and which way (:data:`UP` or :data:`DOWN`)."""

    at: float
    direction: int


@dataclass(frozen=True, slots=True)
class Sizes:
    """One pass's recommendations for one role, engines within the role's bounds."""

    #: what the demand needs: a scale-up goes here
    up: int
    #: what carries the demand with the tolerance spare, at the profile's speed or slower: a scale-down goes no lower
    #: than the largest of these over the stabilization window
    down: int
    #: what the demand's lower bound needs: a scale-up right after a scale-down needs more than runs
    significant: int


def engines(need: float, spare: float = 0.0) -> int:
    """Whole engines for ``need`` engines' worth of work with ``spare`` more (a fraction)."""
    return max(0, math.ceil(need * (1 + spare) - 1e-9))


def settle(current: int, sizes: Sizes, stabilized: int, last: Change | None, now: float, hysteresis: Hysteresis) -> int:
    """The size to ask for a role running ``current`` (the size the planner asked for last), given this pass's
    ``sizes``, the largest ``down`` recommended within the stabilization window (this pass's included) and the role's
    ``last`` change."""
    recent = last is not None and now - last.at < hysteresis.reversal_seconds
    if sizes.up > current:
        if recent and last is not None and last.direction == DOWN and sizes.significant <= current:
            return current  # up right after down, on what chance alone may show
        return sizes.up
    return min(current, stabilized)  # down after up: the up's own recommendation holds it for the window


def changed(last: Change | None, before: int, after: int, now: float) -> Change | None:
    """The role's last change once it goes from ``before`` to ``after``."""
    if after == before:
        return last
    return Change(now, UP if after > before else DOWN)


def warm(last: Change | None, settled: bool, now: float, window_seconds: float, hysteresis: Hysteresis) -> bool:
    """Whether a role's observed latencies may refine its profile: its pods all ready (``settled``), and its last
    change further back than the metrics' window and the warm-up."""
    return settled and (last is None or now - last.at >= window_seconds + hysteresis.warmup_seconds)
