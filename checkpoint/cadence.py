"""Checkpoint cadence from cost and risk: how many steps between two saves of one tier.

A checkpoint costs the training loop some time every time it is taken; a failure costs the work
done since the last one (half an interval on average) plus the restart. The interval that
maximises expected goodput is Young's first-order optimum ``sqrt(2 * C * M)`` for a save cost
``C`` and a mean time between failures ``M`` (J. W. Young, "A first order approximation to the
optimum checkpoint interval", CACM 17(9), 1974), refined by Daly to ``sqrt(2 C M) - C`` while
``C < 2 M`` (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22(3), 2006). With ``C`` a few milliseconds and
``M`` an hour, that is every few seconds; with a fault a minute, close to every step.

Each tier plans for the faults it is there to recover from. A memory checkpoint that another node
holds a copy of recovers the loss of a node, so storage is needed only when every in-memory copy
of some rank's state is gone at once (several nodes, the whole job): behind such a memory tier,
the storage tier plans for those losses (:data:`MEMORY_LOSS`), which are far rarer than faults.
Where the ranks change rounds in place and each holds the whole state (replicated data parallel,
the GRPO trainer with one optimizer pass a step), the surviving ranks are the level below memory:
a node's loss costs no checkpoint at all (a newcomer gets the state from a live rank), so the
memory tier too plans only for what the survivors cannot recover (:data:`IN_PLACE_MISS`: every
rank lost together, a fallback to a restart). This is multi-level checkpointing (A. Moody,
G. Bronevetsky, K. Mohror, B. R. de Supinski, "Design, Modeling, and Evaluation of a Scalable
Multi-level Checkpointing System", SC 2010), where each level's interval follows the rate of the
failures that need that level.

Everything here is a pure function of its inputs, so the decision can be tested with made-up
numbers, and so that every rank of a job reaches the same decision when it is given the same
inputs (the ranks must save together: give them agreed numbers, e.g. all-reduced, see
:meth:`Cadence.update`).

- :func:`young_daly_interval`: the optimum in seconds.
- :func:`estimate_mtbf`: the MTBF to plan for: configured, observed from the job's fault
  history, or a prior while no fault has been seen.
- :func:`choose_interval`: the interval in seconds of training, capped, with the reason in words.
- :class:`Cadence`: one tier's schedule (a fixed ``N`` or ``"auto"``) that the training loop asks
  :meth:`Cadence.due` each step.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal, Union

from ftrt.errors import ConfigError

log = logging.getLogger(__name__)

Interval = Union[int, Literal["auto"]]
"""A tier's configured interval: a fixed number of steps (0: never) or ``"auto"``."""

PRIOR_MTBF_S = 3600.0
"""The MTBF planned for while a job has seen no fault and none is configured: one hour. A job
that runs longer than that without a fault plans for its own age instead (see
:func:`estimate_mtbf`)."""


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Seconds of work between checkpoints that maximise expected goodput (Young/Daly).

    ``sqrt(2 C M) - C`` while ``C < 2 M`` (Daly's higher-order estimate; Young's first order
    without the ``- C``), else ``M``: saving takes longer than the failures leave.
    """
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"save cost ({save_cost_s} s) must be >= 0 and MTBF ({mtbf_s} s) > 0")
    if save_cost_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * save_cost_s * mtbf_s) - save_cost_s


@dataclass(frozen=True)
class MtbfEstimate:
    """The MTBF to plan for and where it came from (for the log line)."""

    seconds: float
    source: str


FAULT = ("fault", "faults")
"""What an MTBF counts by default: faults, a node or a worker lost (:func:`estimate_mtbf`)."""
MEMORY_LOSS = ("loss of memory checkpoints", "losses of memory checkpoints")
"""What the storage tier's MTBF counts behind a memory tier that recovers a node's loss."""
IN_PLACE_MISS = ("fault the live ranks did not recover", "faults the live ranks did not recover")
"""What the memory tier's MTBF counts where the live ranks recover a node's loss in place, each
holding the whole state: a loss of every rank at once, a fallback to a restart."""


def estimate_mtbf(configured_s: float | None, faults: int, elapsed_s: float,
                  prior_s: float = PRIOR_MTBF_S, *, counted: tuple[str, str] = FAULT) -> MtbfEstimate:
    """The MTBF to plan for.

    - configured (``--mtbf`` or the trainer's setting): that, always;
    - ``faults`` failures in the job's ``elapsed_s`` so far: ``elapsed_s / faults``;
    - none yet: the larger of ``prior_s`` and the job's age (a job that has run two hours
      without a fault has shown an MTBF of at least two hours).

    ``counted`` names what ``faults`` counts (singular, plural) for the estimate's source:
    :data:`FAULT`, :data:`MEMORY_LOSS` for a storage tier behind a memory tier, or
    :data:`IN_PLACE_MISS` for a memory tier behind ranks that recover in place.
    """
    one, many = counted
    if configured_s is not None:
        if configured_s <= 0:
            raise ConfigError(f"The MTBF must be a positive number of seconds, got {configured_s!r}.")
        return MtbfEstimate(configured_s, "configured")
    elapsed = max(elapsed_s, 0.0)
    if faults > 0 and elapsed > 0:
        return MtbfEstimate(elapsed / faults, f"observed: {faults} {one if faults == 1 else many} in {elapsed:.0f} s")
    if elapsed > prior_s:
        return MtbfEstimate(elapsed, f"observed: no {one} in {elapsed:.0f} s")
    return MtbfEstimate(prior_s, f"prior: no {one} yet in {elapsed:.0f} s")


@dataclass(frozen=True)
class Choice:
    """An interval (seconds of training between saves) and the numbers behind it."""

    seconds: float
    reason: str


def choose_interval(save_cost_s: float, mtbf: MtbfEstimate, *, max_interval_s: float) -> Choice:
    """Seconds of training between two saves: the Young/Daly interval, at most ``max_interval_s``
    (a bound on what one fault can cost, whatever the estimate says)."""
    ideal_s = young_daly_interval(save_cost_s, mtbf.seconds)
    clamp = f", capped at {max_interval_s:g} s" if ideal_s > max_interval_s else ""
    return Choice(min(ideal_s, max_interval_s),
                  f"save cost {save_cost_s * 1000:.1f} ms, MTBF {mtbf.seconds:.0f} s ({mtbf.source}): "
                  f"Young/Daly interval {ideal_s:.2f} s{clamp}")


def parse_interval(field: str, value: object) -> Interval:
    """``"auto"`` or a whole number of steps >= 0, else a :class:`ConfigError` naming ``field``."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{field} = {value!r} is invalid: give 'auto' or a number of steps >= 0.")
    return value


class Cadence:
    """When one checkpoint tier saves: every ``N`` steps, never (0), or ``"auto"``.

    In ``auto`` mode the first save is due on the first step (it measures what a save costs);
    after that a save is due once the training time since the last one reaches the interval
    :func:`choose_interval` gives for the median cost of the recent saves and the MTBF,
    re-chosen at each :meth:`update`. A new interval replaces the current one only when it
    differs by more than ``HYSTERESIS`` (so noise does not flip it back and forth), and each one
    is reported with its numbers. Give :meth:`update` the same numbers on every rank (e.g.
    all-reduced): the ranks of a job save together, and a pure decision on equal inputs keeps
    them together.

    Args:
        name: the tier, for log lines ("memory", "storage").
        interval: steps between saves, 0 for none, or ``"auto"``.
        max_interval_s: the most training time ``auto`` lets go unsaved.
        mtbf: ``(faults, elapsed_s) -> MtbfEstimate`` (usually :func:`estimate_mtbf` bound to the
            job's configuration); called at each update.
        on_choice: called as ``on_choice(name, choice)`` with each new :class:`Choice`
            (default: a log line).
    """

    COSTS_KEPT = 5
    HYSTERESIS = 0.2

    def __init__(self, name: str, interval: Interval, *, max_interval_s: float,
                 mtbf: Callable[[int, float], MtbfEstimate],
                 on_choice: Callable[[str, Choice], None] | None = None) -> None:
        self.name = name
        self.interval = parse_interval(f"{name} interval", interval)
        if max_interval_s <= 0:
            raise ConfigError(f"The {name} checkpoint's max interval must be > 0 s, got {max_interval_s!r}.")
        self.max_interval_s = max_interval_s
        self._mtbf = mtbf
        self._on_choice = on_choice or (
            lambda n, c: log.info("%s checkpoints every %.2f s of training: %s", n, c.seconds, c.reason))
        self._costs: deque[float] = deque(maxlen=self.COSTS_KEPT + 1)
        self.choice: Choice | None = None
        """The current ``auto`` interval (None until a save has been measured, or when fixed)."""
        self.last_saved: int | None = None
        self._work_s = 0.0  # training time since the last save
        self._measuring = False  # a save's cost is on its way to update() and no interval exists yet
        self._longest_s = max_interval_s  # the longest interval any save cost could give, at the last update

    def due(self, step: int) -> bool:
        """Whether this tier saves after ``step`` (counted from 1, like the step a save records)."""
        if self.interval == 0:
            return False
        if self.interval != "auto":
            return step % self.interval == 0
        if self.choice is None:
            if self._measuring:  # wait for the first cost, no longer than any cost could make it
                return self._work_s >= self._longest_s
            return self.last_saved != step
        return self.last_saved is not None and step > self.last_saved and self._work_s >= self.choice.seconds

    def saved(self, step: int, *, measured: bool = True) -> None:
        """Record that this tier saved ``step``, or that the run resumed from it.

        ``measured``: whether this save's cost will reach :meth:`update` (False for a resume, or
        for a copy made as part of another tier's save). Until an interval exists, a measured
        save is the one that sets it, so no other is due while its cost is on its way (on slow
        storage that takes several steps).
        """
        self.last_saved = step
        self._work_s = 0.0
        self._measuring = measured and self.choice is None

    def update(self, *, step_s: float, save_cost_s: float | None, faults: int, elapsed_s: float) -> Choice | None:
        """Take one step's agreed numbers: its duration, the cost of a save that became final since
        the last update (or None), and the job's fault count and age. Returns the interval when
        it changed (and reports it), else None."""
        if self.interval != "auto":
            return None
        self._work_s += max(step_s, 0.0)
        mtbf = self._mtbf(faults, elapsed_s)
        # Young/Daly never exceeds the MTBF, whatever the cost: the bound while none is measured.
        self._longest_s = min(self.max_interval_s, mtbf.seconds)
        if save_cost_s is not None:
            self._costs.append(max(save_cost_s, 0.0))
            self._measuring = False
        if not self._costs:
            return None
        # The first save also allocates the staging buffers: leave it out once there are others.
        costs = list(self._costs)[1:] if len(self._costs) > 1 else list(self._costs)
        choice = choose_interval(statistics.median(costs), mtbf,
                                 max_interval_s=self.max_interval_s)
        current = self.choice
        if current is not None and abs(choice.seconds - current.seconds) <= self.HYSTERESIS * current.seconds:
            return None
        self.choice = choice
        self._on_choice(self.name, choice)
        return choice


__all__ = ["Cadence", "Choice", "FAULT", "IN_PLACE_MISS", "Interval", "MEMORY_LOSS", "MtbfEstimate", "PRIOR_MTBF_S",
           "choose_interval", "estimate_mtbf", "parse_interval", "young_daly_interval"]
