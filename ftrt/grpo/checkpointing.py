"""When the GRPO trainer checkpoints: its memory and storage cadences, fed agreed numbers, the
decision what a step's save is, and the one save in flight.

Both tiers' intervals are ``auto`` by default (:mod:`ftrt.checkpoint.cadence`: the Young/Daly
interval from the measured save cost and the MTBF). Saves are collective, so every rank must
decide alike: each rank's inputs (its last step time, the job's age, the costs of its saves that
became final) ride on the step's existing all-reduce, and the cadences are fed the agreed sums.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftrt.grpo.config import GRPOConfig
from ftrt.runtime import Runtime

if TYPE_CHECKING:
    from ftrt.checkpoint.cadence import Cadence, Choice, Interval
    from ftrt.checkpoint.checkpointer import Checkpointer, SaveHandle


class Cadences:
    """When the trainer checkpoints: the memory and storage tiers' :class:`Cadence` and the cost
    measurements that feed their ``auto`` modes (each save's :attr:`SaveHandle.cost_s`, reported
    once it is final).

    Every rank must decide alike: :meth:`report` gives the numbers this rank contributes to the
    step's all-reduce (sums), and :meth:`update` feeds the agreed totals to both cadences.
    ``nodes``: how many nodes this round has.
    """

    def __init__(self, rt: Runtime, cfg: GRPOConfig, ck: Checkpointer | None, *, announce: bool,
                 nodes: int) -> None:
        c = cfg.checkpoint

        def say(tier: str, choice: Choice) -> None:
            if announce:
                print(f"[ftrt.grpo] {tier} checkpoints every {choice.seconds:.2f} s of training: {choice.reason}",
                      flush=True)

        memory = c.memory_interval if ck is not None and ck.has_memory_tier else 0
        self.rt = rt
        self._say = say
        self._cfg = c
        node_loss_stays_active = nodes == 1 or nodes > rt.min_nodes  # one node's loss is the job's anyway
        self.behind_peers = (memory != 0 and rt.in_place and rt.world_size > 1 and cfg.steps_stand_alone
                             and node_loss_stays_active)
        """Whether the live ranks recover any one lost node or worker here without a checkpoint: in
        place, two or more ranks, each holding the whole state and a whole step between two steps
        (:attr:`GRPOConfig.steps_stand_alone`), and a lost node leaves a round that still runs
        (``nodes`` in this round, above ``--nnodes MIN``; on one node its loss is the job's, which
        only storage recovers). The memory tier then plans for the faults they do not recover (the
        trainer's restores: every rank lost at once, a loss below MIN, a fallback to a restart)."""
        self.memory = self._memory_cadence(memory)
        self.behind_memory = memory != 0 and rt.world_size > rt.local_world_size
        """Whether the memory tier recovers a node's loss here (its copies are replicated to another
        node), so that the storage tier plans for losses of every memory copy, not for every fault."""
        self.storage = self._storage_cadence()
        self._checkpointing = ck is not None
        self._unsettled: list[SaveHandle] = []

    def _memory_cadence(self, memory: "Interval") -> "Cadence":
        c = self._cfg
        if self.behind_peers:
            return self.rt.cadence("memory", memory, max_interval_s=c.memory_max_interval_s, on_choice=self._say,
                                   behind_peers=True)
        return self.rt.cadence("memory", memory, max_interval_s=c.memory_max_interval_s, mtbf=c.mtbf,
                               on_choice=self._say)

    def _storage_cadence(self) -> "Cadence":
        c = self._cfg
        if self.behind_memory:
            return self.rt.cadence("storage", c.interval, max_interval_s=c.max_interval_s, mtbf=c.storage_mtbf,
                                   on_choice=self._say, behind_memory=True)
        return self.rt.cadence("storage", c.interval, max_interval_s=c.max_interval_s, mtbf=c.mtbf,
                               on_choice=self._say)

    def resumed(self, step: int, tier: str | None) -> None:
        """The run restored ``step`` from ``tier`` ("memory" or "storage"): both tiers count their
        next save from there.

        A restore from storage after a fault shows that the memory tier did not recover it: for
        the rest of this round the storage tier plans for every fault again.
        """
        if self.behind_memory and tier == "storage" and self.rt.faults > 0:
            self.behind_memory = False
            self.storage = self._storage_cadence()
        self.memory.saved(step, measured=False)
        self.storage.saved(step, measured=False)

    def started(self, handle: SaveHandle) -> None:
        """A save began (``handle`` from ``Checkpointer.save``)."""
        if handle.skipped:
            return
        # A storage save also leaves a memory copy (with the tier); its cost is the storage tier's.
        self.memory.saved(handle.step, measured=not handle.persisting)
        if handle.persisting:
            self.storage.saved(handle.step)
        self._unsettled.append(handle)

    def report(self, step_s: float) -> list[float]:
        """This rank's contribution to the step's all-reduce: the last step's duration, the job's
        age, and the costs of its saves that became final since the last report."""
        out = [step_s, time.time() - self.rt.job_started, 0.0, 0.0, 0.0, 0.0]
        for h in [h for h in self._unsettled if h.settled()]:
            self._unsettled.remove(h)
            at = 4 if h.persisting else 2
            out[at] += h.cost_s
            out[at + 1] += 1
        return out

    def update(self, agreed: list[float], world: int, *, restores: int) -> None:
        """Feed the all-reduced sums of :meth:`report` (over ``world`` ranks) to both cadences;
        ``restores``: how often the job restored a checkpoint (the trainer's ``resumes``, the same on
        every rank), what a memory tier behind the live ranks plans for."""
        step_s, age, mem_sum, mem_n, sto_sum, sto_n = agreed
        memory_faults = restores if self.behind_peers else self.rt.faults
        for cadence, total, n, faults in ((self.memory, mem_sum, mem_n, memory_faults),
                                          (self.storage, sto_sum, sto_n, self.rt.faults)):
            cadence.update(step_s=step_s / world, save_cost_s=total / n if n else None,
                           faults=faults, elapsed_s=age / world)

    def decide(self, done: int, steps: int, *, round_ends: bool, durable: bool = False) -> "SaveDecision":
        """What to save once ``done`` of ``steps`` steps are trained (see :func:`decide_save`)."""
        return decide_save(done, steps, checkpointing=self._checkpointing, round_ends=round_ends, durable=durable,
                           storage_due=self.storage.due(done), memory_due=self.memory.due(done))


@dataclass(frozen=True)
class SaveDecision:
    """The save due after a step."""

    persist: bool
    """Save to storage (which also leaves a memory copy when the job has a memory tier)."""
    keep: bool
    """Save at all: ``persist``, a memory copy, or the save a round ends with."""
    skip_if_busy: bool
    """Skip the save (memory copy only) when an unfinished one would make it queue."""

    @property
    def tier(self) -> str | None:
        """``"storage"``, ``"memory"`` or None, as the step's metrics line records it."""
        return "storage" if self.persist else "memory" if self.keep else None


def decide_save(done: int, steps: int, *, checkpointing: bool, round_ends: bool, storage_due: bool,
                memory_due: bool, durable: bool = False) -> SaveDecision:
    """The save due once ``done`` of ``steps`` steps are trained.

    The last step is always saved to storage. A round that ends after this step (a node joins or
    drains) ends with a save kept in memory, which is enough for the next round; ``durable``
    (the next round is inactive: the job waits or stops, and the memory copies may leave with
    the nodes) makes it a storage save, which the round fence accepts at a planned change's
    boundary. Slow storage must not slow training, so a save that would queue behind an
    unfinished one is skipped; the final one, and the one a round ends with, never are.
    """
    persist = checkpointing and (round_ends and durable or not round_ends and (storage_due or done == steps))
    keep = persist or round_ends or (checkpointing and memory_due)
    return SaveDecision(persist=persist, keep=keep, skip_if_busy=done < steps and not round_ends)


class Saves:
    """The trainer's saves: starts the one a :class:`SaveDecision` asks for and holds it while in
    flight, so that the optimizer does not change the weights before the save has copied them."""

    def __init__(self, ck: Checkpointer | None, cadences: Cadences, state: dict[str, Any]) -> None:
        self.ck = ck
        self.cadences = cadences
        self.state = state
        self._pending: SaveHandle | None = None

    def before_update(self) -> None:
        """Wait until the save in flight has copied the weights (call before ``optimizer.step()``)."""
        if self._pending is not None:
            self._pending.wait_staged()
            self._pending = None

    def start(self, done: int, decision: SaveDecision) -> None:
        """Start the save ``decision`` asks for after step ``done`` (none: nothing happens)."""
        if not decision.keep:
            return
        self._pending = self.ck.save(done, self.state, persist=decision.persist, skip_if_busy=decision.skip_if_busy)
        self.cadences.started(self._pending)

    def wait(self) -> None:
        """Wait until the save in flight is complete (the next round resumes from it)."""
        self._pending.wait()

    def close(self) -> None:
        """Wait for the last save and release the checkpointer: the final state is committed."""
        if self.ck is not None:
            self.ck.close()
