"""The worker processes of one node as ranks of rounds: warm spares, assignment, exits, stopping.

The pool keeps ``nproc`` spares warm (torch imported; the one meant for local rank 0 also holds a
TCPStore server on a fresh port), hands them out for a round (:meth:`WorkerPool.take`,
:meth:`WorkerPool.assign`), and replaces them in the background at idle CPU priority so a spare's
warm-up does not slow the running workers. Replacements are forked from the spare template
(:mod:`ftrt.agents.workers.template`) once it is warm.

Processes themselves (starting, output, reports, signals, reaping) are the business of
:mod:`ftrt.agents.workers.procs`; a :class:`Worker` is one such process as the pool sees it: its
state and, once assigned, its rank, round and progress. The assignment travels on the worker's
control channel (:meth:`Proc.send <ftrt.agents.workers.procs.Proc.send>`, one JSON line); that is
also where a worker kept in place gets its next round (:meth:`WorkerPool.hand_round`,
:mod:`ftrt.agents.workers.keep`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from ftrt import _diag, reports
from ftrt.control import NewRound, encode
from ftrt.agents.workers.boundary import Deferral
from ftrt.agents.workers.keep import keep_in_place
from ftrt.agents.workers.procs import Proc, Spawned, spawn_bootstrap, stop
from ftrt.agents.workers.template import SpareTemplate, TemplateError, spawn_template
from ftrt.agents.workers.warmup import IDLE_WARM_GRACE

log = logging.getLogger(__name__)

REFILL_PROGRESS_WAIT = 10.0
"""Longest wait for the running workers' first heartbeat before used spares are replaced."""


class WorkerState(str, enum.Enum):
    """A worker's life: ``warming -> warm -> running -> exited`` (a spare may exit from any state);
    a worker started before its node is admitted is ``pending`` between ``warm`` and ``running``.
    The values are what ``ftrt status`` and the Status RPC show."""

    WARMING = "warming"
    WARM = "warm"
    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"


@dataclass(eq=False)
class Worker:
    """One worker process as the pool sees it: a spare, or a rank of a round."""

    proc: Proc
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it is warm (or has exited: nobody waits forever on a dead spare)."""
    store_port: int = 0
    state: WorkerState = WorkerState.WARMING
    local_rank: int = -1
    rank: int = -1
    round: int = 0
    taken_round: int = 0
    """The round this worker is known to run: the one it was started in, or the last it said it took
    in place (:class:`~ftrt.reports.Reconfigured`). Its heartbeats count for that round; ``round``
    may already name the next one, handed over but not taken yet."""
    step: int = -1
    last_heartbeat: float | None = None
    step_interval: float | None = None
    """Seconds per step between its last two heartbeats (None before two)."""
    done_at: float | None = None
    """When it said its work is done (:meth:`ftrt.Runtime.done`; monotonic): from then on its
    teardown is not judged for hangs, only held to ``--teardown-timeout``."""
    teardown_cut: bool = False
    """Killed past ``--teardown-timeout`` after it said it was done: its exit counts as success."""
    polls_boundary: bool = False
    """It polls the round-end file (:mod:`ftrt.agents.workers.boundary`): a planned round waits for it."""
    ends_after: Deferral | None = None
    """It said it ends its round only after a later step (:class:`~ftrt.reports.BoundaryAt`)."""
    said_in_place: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it said it changes rounds in place (:class:`~ftrt.reports.InPlace`); for a worker
    started before its node is admitted, that it is warm."""
    took_round: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it acknowledged the round it was last handed (:meth:`WorkerPool.hand_round`)."""
    assigned_at: float = 0.0
    since_round: int = 0
    """The round this process was first assigned in (it may have taken later ones in place)."""
    stopping: bool = False

    @property
    def in_place(self) -> bool:
        """It changes rounds without exiting: a new round is handed to it."""
        return self.said_in_place.is_set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        return self.proc.exit_code

    @property
    def exited(self) -> asyncio.Event:
        return self.proc.exited

    @property
    def hosts_store(self) -> bool:
        return self.proc.hosts_store

    @property
    def spawned_at(self) -> float:
        return self.proc.spawned_at

    def heard(self, report: reports.Report) -> None:
        """Take in what a report says about this worker itself (readiness, progress)."""
        match report:
            case reports.Ready(store_port=port):
                self.store_port = port
                if self.state is WorkerState.WARMING:
                    self.state = WorkerState.WARM
                self.ready.set()
            case reports.Heartbeat(step=step):
                now = time.monotonic()
                if self.last_heartbeat is not None and step > self.step >= 0:
                    self.step_interval = (now - self.last_heartbeat) / (step - self.step)
                self.step, self.last_heartbeat = step, now
            case reports.Done(step=step):
                if self.done_at is None:
                    self.done_at = time.monotonic()
                    log.info("rank %d is done (step %s); its teardown is not judged for hangs", self.rank, step)
            case reports.Boundary():
                self.polls_boundary = True
            case reports.BoundaryAt(round=round_no, step=step):
                self.ends_after = Deferral(round_no, time.monotonic(), self.step, step)
            case reports.InPlace():
                self.said_in_place.set()
            case reports.Reconfigured(round=round_no):
                self.taken_round = max(self.taken_round, round_no)
                if round_no == self.round:
                    self.took_round.set()


class WorkerPool:
    """Spawns, assigns, watches and stops this node's workers.

    Args:
        nproc: workers per round.
        fence_path: the agent's fence file, given to every worker.
        warm: keep spares warm; without it every start is cold.
        warm_imports: modules a spare imports while it waits.
        base_env: environment for workers (the agent's, plus anything the agent adds).
        log_dir: with it, each worker's output also goes to ``round-R/rank-N.log`` there.
        on_exit: called as ``on_exit(worker)`` when an assigned worker exits (not when stopped).
        on_heartbeat: called as ``on_heartbeat(worker)`` on each heartbeat.
        on_memory: called as ``on_memory(rank, step)`` when a worker's memory checkpoint is complete.
        on_report: called as ``on_report(worker, report)`` with a worker's checkpoint, restore and
            trainer reports (:class:`~ftrt.reports.MemorySaved`, ``Committed``, ``Restored``, ``Stats``).
        out: where workers' output lines go (default: the agent's stdout).
    """

    def __init__(
        self,
        *,
        nproc: int,
        fence_path: str,
        warm: bool,
        warm_imports: tuple[str, ...],
        base_env: dict[str, str],
        log_dir: str | None,
        on_exit: Callable[[Worker], None],
        on_heartbeat: Callable[[Worker], None] | None = None,
        on_memory: Callable[[int, int], None] | None = None,
        on_report: Callable[[Worker, reports.Report], None] | None = None,
        out: IO[bytes] | None = None,
    ) -> None:
        self.nproc = nproc
        self.fence_path = fence_path
        self.warm = warm
        self.warm_imports = warm_imports
        self.base_env = base_env
        self.log_dir = log_dir
        self.on_exit = on_exit
        self.on_heartbeat = on_heartbeat
        self.on_memory = on_memory
        self.on_report = on_report
        self.out = out if out is not None else sys.stdout.buffer
        self.spares: list[Worker] = []
        """Warm or warming workers for the next round (read-only outside the pool)."""
        self.running: list[Worker] = []
        """The workers assigned in the current round (read-only outside the pool)."""
        self.early: list[Worker] = []
        """Workers started before this node is admitted to the job (:meth:`start_early`; read-only
        outside the pool): the round that admits the node keeps them (:meth:`keep`)."""
        self._all: set[Worker] = set()
        self._closed = False
        self._refill: asyncio.Task | None = None
        self._template: SpareTemplate | None = None
        """The running spare template, once a refill started one (None before, or after it failed)."""
        self._templates = warm and not _diag.off("template")
        """Whether replacement spares are forked from a template (off after a template failed)."""

    # -- processes ------------------------------------------------------------------------------
    def adopt(self, spawned: Spawned) -> Worker:
        """Watch a started bootstrap process as a spare."""
        worker: Worker  # the process's callbacks run on the loop, after it is assigned below
        proc = Proc(spawned, out=self.out, on_report=lambda r: self._heard(worker, r),
                    on_exit=lambda: self._exited(worker))
        worker = Worker(proc)
        self._all.add(worker)
        return worker

    def adopt_spares(self, spawned: list[Spawned]) -> None:
        """Take over spares the CLI started before the event loop existed."""
        self.spares.extend(self.adopt(s) for s in spawned)

    def adopt_template(self, spawned: Spawned, sock: socket.socket) -> SpareTemplate:
        """Watch a started spare template; spares are forked from it once it is warm."""
        tpl: SpareTemplate  # as in adopt
        proc = Proc(spawned, out=self.out, on_report=lambda r: self._template_heard(tpl, r),
                    on_exit=lambda: self._template_exited(tpl))
        tpl = SpareTemplate(proc, sock)
        self._template = tpl
        log.info("spare template pid %d started: spares will be forked from it", proc.pid)
        return tpl

    def _spawn(self, *, hosts_store: bool, idle: bool) -> Worker:
        """A new spare: forked from the template when one is warm, else a new process."""
        tpl = self._template
        if tpl is not None and tpl.usable:
            try:
                return self.adopt(tpl.fork(hosts_store))
            except TemplateError as exc:
                log.warning("%s; starting spares directly", exc)
        return self.adopt(spawn_bootstrap(
            base_env=self.base_env, fence_path=self.fence_path, warm_imports=self.warm_imports,
            hosts_store=hosts_store, idle=idle,
        ))

    def _heard(self, worker: Worker, report: reports.Report) -> None:
        worker.heard(report)
        match report:
            case reports.Heartbeat():
                if self.on_heartbeat is not None:
                    self.on_heartbeat(worker)
            case reports.MemorySaved(rank=rank, step=step):
                if self.on_memory is not None:
                    self.on_memory(rank, step)
                if self.on_report is not None:
                    self.on_report(worker, report)
            case reports.Committed() | reports.Restored() | reports.Stats():
                if self.on_report is not None:
                    self.on_report(worker, report)

    def _exited(self, worker: Worker) -> None:
        worker.ready.set()  # nobody waits forever on a dead spare
        if worker in self.early:
            self.early.remove(worker)
            if not worker.stopping:
                log.warning("worker pid %d, started before this node's admission, exited with code %s before "
                            "it was admitted", worker.pid, worker.exit_code)
        if worker in self.spares:
            self.spares.remove(worker)
            if not self._closed:
                log.warning("spare worker pid %d exited with code %s while warm", worker.pid, worker.exit_code)
                self.refill_later(1.0)
        previous, worker.state = worker.state, WorkerState.EXITED
        if previous is WorkerState.RUNNING and not worker.stopping:
            self.on_exit(worker)
        self._all.discard(worker)

    # -- the spare template ---------------------------------------------------------------------
    def _start_template(self, *, idle: bool) -> SpareTemplate:
        return self.adopt_template(*spawn_template(
            base_env=self.base_env, fence_path=self.fence_path, warm_imports=self.warm_imports, idle=idle))

    def _template_heard(self, tpl: SpareTemplate, report: reports.Report) -> None:
        tpl.on_report(report)
        if isinstance(report, reports.Ready):
            self.fill_spares()

    def _template_exited(self, tpl: SpareTemplate) -> None:
        tpl.lost()
        if self._template is tpl:
            self._template = None
        if not self._closed:
            log.warning("the spare template pid %d exited with code %s; spares start directly from now on",
                        tpl.proc.pid, tpl.proc.exit_code)
            self._templates = False

    async def _template_ready(self, idle_grace: float) -> None:
        """Start the template if there is none, and wait until it is warm (boosted after
        ``idle_grace`` seconds at idle priority) or gone."""
        if not self._templates:
            return
        tpl = self._template or self._start_template(idle=bool(self.running))
        try:
            await asyncio.wait_for(tpl.ready.wait(), idle_grace)
        except asyncio.TimeoutError:
            tpl.proc.boost()
            await tpl.ready.wait()

    async def _awaiting_template(self, boost: bool = False) -> None:
        """If spares are missing and the template that fills them warms, wait for it (moved to
        normal priority if ``boost``)."""
        tpl = self._template
        if tpl is None or not tpl.warming or len(self.spares) >= self.nproc:
            return
        if boost:
            tpl.proc.boost()
        await tpl.ready.wait()
        self.fill_spares()  # a template that failed meanwhile: started directly

    # -- spares ---------------------------------------------------------------------------------
    def fill_spares(self, *, idle: bool = False) -> None:
        """Start spares until ``nproc`` are warm or warming (one of them holding a store). While
        the template warms, nothing: it fills the spares once warm."""
        if not self.warm or self._closed:
            return
        if self._template is not None and self._template.warming:
            return
        while len(self.spares) < self.nproc:
            need_store = not any(w.hosts_store for w in self.spares)
            self.spares.append(self._spawn(hosts_store=need_store, idle=idle))

    def refill_later(self, delay: float, idle_grace: float = IDLE_WARM_GRACE) -> None:
        """Replace used spares at idle priority, ``delay`` seconds after the round started and once
        every running worker has heartbeaten (at most :data:`REFILL_PROGRESS_WAIT` more); boost
        them to normal priority if they are not warm ``idle_grace`` seconds later."""
        if not self.warm or self._closed or _diag.off("refill"):
            return
        if self._refill is not None and not self._refill.done():
            return

        async def run() -> None:
            await asyncio.sleep(delay)
            # The new round's workers restore and rebuild first: warming spares beside them on a
            # small machine would slow exactly the recovery they exist to speed up.
            deadline = time.monotonic() + REFILL_PROGRESS_WAIT
            while time.monotonic() < deadline and any(
                w.exit_code is None and (w.last_heartbeat or 0.0) < w.assigned_at for w in self.running
            ):
                await asyncio.sleep(0.1)
            t0 = time.monotonic()
            if len(self.spares) >= self.nproc:
                return
            await self._template_ready(idle_grace)
            self.fill_spares(idle=bool(self.running))
            try:
                await asyncio.wait_for(self.spares_ready(), idle_grace)
            except asyncio.TimeoutError:
                # The machine has no idle CPU to give: finish warming at normal priority rather
                # than meet the next fault without spares.
                for w in self.spares:
                    if not w.ready.is_set():
                        w.proc.boost()
                await self.spares_ready()
            log.info("spares warm again after %.1f s", time.monotonic() - t0)

        self._refill = asyncio.create_task(run())

    async def spares_ready(self) -> None:
        """Wait until every spare has reported ready (and the template they are forked from)."""
        await self._awaiting_template()
        for w in list(self.spares):
            await w.ready.wait()

    @property
    def warm_count(self) -> int:
        return sum(1 for w in self.spares if w.ready.is_set() and w.exit_code is None)

    async def take(self, count: int | None = None, *, store: bool = True) -> list[Worker]:
        """``count`` workers for a round (default ``nproc``), index 0 holding a TCPStore when
        ``store`` (it becomes local rank 0); cold-started if needed."""
        count = self.nproc if count is None else count
        if count == 0:
            return []  # every worker kept in place: nothing to wait for (a template still warming)
        await self._awaiting_template(boost=True)
        alive = [w for w in self.spares if w.exit_code is None]
        store_holders = [w for w in alive if w.hosts_store]
        first: list[Worker] = []
        if store and count > 0:
            first = [store_holders[0] if store_holders else self._spawn(hosts_store=True, idle=False)]
        rest = [w for w in alive if w not in first][: count - len(first)]
        while len(first) + len(rest) < count:
            rest.append(self._spawn(hosts_store=False, idle=False))
        chosen = [*first, *rest]
        self.spares = [w for w in self.spares if w not in chosen and w.exit_code is None]
        for w in chosen:
            if not w.ready.is_set():
                w.proc.boost()  # a spare still warming at idle priority is needed now
        return chosen

    # -- assignment -----------------------------------------------------------------------------
    def assign(self, worker: Worker, *, local_rank: int, rank: int, round_no: int, env: dict[str, str],
               script: str | None, module: str | None, argv: tuple[str, ...]) -> None:
        """Send the worker its job; it starts running the script as soon as it is warm."""
        self._place(worker, local_rank=local_rank, rank=rank, round_no=round_no)
        worker.taken_round = round_no  # a fresh worker runs the round it was assigned from its start
        worker.since_round = round_no
        worker.state = WorkerState.RUNNING
        if not worker.proc.send(_job(env, script, module, argv)):  # it died meanwhile: its exit is reported as usual
            log.warning("could not hand rank %d to worker pid %d: it is gone", rank, worker.pid)
        self.running.append(worker)  # its control pipe stays open: it may take later rounds in place

    def start_early(self, worker: Worker, *, local_rank: int, env: dict[str, str], script: str | None,
                    module: str | None, argv: tuple[str, ...]) -> None:
        """Start ``worker`` (from :meth:`take`) on the script before its node is admitted
        (:func:`~ftrt.agents.workers.env.pending_env`): it warms up, says it changes rounds in place
        (:attr:`Worker.said_in_place`), and waits for its first round, which the round admitting the
        node hands it (:meth:`keep`, :meth:`hand_round`)."""
        worker.local_rank = local_rank
        worker.state = WorkerState.PENDING
        worker.assigned_at = time.monotonic()
        self._output(worker, f"pending/local-rank-{local_rank}.log", f"[local{local_rank}]: ")
        if not worker.proc.send(_job(env, script, module, argv)):
            log.warning("could not start worker pid %d before admission: it is gone", worker.pid)
        self.early.append(worker)

    async def wait_in_place(self, workers: list[Worker], timeout: float) -> bool:
        """Wait until each of ``workers`` said it changes rounds in place, or exited, at most
        ``timeout`` seconds; True if every one said so and lives."""
        await _each_or_exit(workers, lambda w: w.said_in_place, timeout)
        return all(w.said_in_place.is_set() and w.exit_code is None for w in workers)

    def hand_round(self, worker: Worker, *, local_rank: int, rank: int, round_no: int, env: dict[str, str],
                   adds_to: int | None = None) -> bool:
        """Hand a running worker that changes rounds in place its next round (:mod:`ftrt.control`);
        :attr:`Worker.took_round` is set once it acknowledged. False if it can no longer hear it.
        ``adds_to``: the round this one only adds members to (a join, :func:`~ftrt.agents.workers.keep.is_join`)."""
        self._place(worker, local_rank=local_rank, rank=rank, round_no=round_no)
        if not worker.since_round:  # started before its node's admission: this is its first round
            worker.since_round = round_no
        worker.took_round = asyncio.Event()
        return worker.proc.send_line(encode(NewRound(round_no, env, adds_to)))

    def _place(self, worker: Worker, *, local_rank: int, rank: int, round_no: int) -> None:
        """Give ``worker`` its rank in round ``round_no``: its fields, and where its output goes."""
        worker.local_rank, worker.rank, worker.round = local_rank, rank, round_no
        worker.assigned_at = time.monotonic()
        self._output(worker, f"round-{round_no}/rank-{rank}.log", f"[rank{rank}]: ")

    def _output(self, worker: Worker, name: str, prefix: str) -> None:
        """Where ``worker``'s output goes from now on: ``name`` under ``--log-dir`` (also), with
        ``prefix`` on each line."""
        if self.log_dir:
            path = Path(self.log_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            worker.proc.log_to(str(path), prefix.encode())
        else:
            worker.proc.prefix = prefix.encode()

    async def keep(self, *, recovery: str, holds_store: bool) -> dict[int, Worker]:
        """The running workers that take the next round in place, by local rank
        (:func:`~ftrt.agents.workers.keep.keep_in_place`); the others (exited, failed) are stopped
        at once and forgotten, to make room for spares. Empty: nothing kept, nothing stopped.

        A node being admitted has no running workers but may have workers started early
        (:meth:`start_early`): those are kept alike, and stopped when they cannot be kept."""
        admitting = bool(self.early) and not self.running
        if admitting:
            self.running, self.early = self.early, []
            for w in self.running:
                w.state = WorkerState.RUNNING  # its exit from now on fails the round, as any rank's
        kept = keep_in_place(self.running, nproc=self.nproc, recovery=recovery, holds_store=holds_store)
        if not kept and admitting:
            log.warning("the workers started before this node's admission are not usable in place; fresh ones start")
            await self.stop_running(0.0)
        elif kept:
            gone = [w for w in self.running if w not in kept.values()]
            self.running = [w for w in self.running if w in kept.values()]
            await self._stop(gone, 0.0)
        return kept

    def give_back(self, workers: list[Worker]) -> None:
        """Return workers :meth:`take` handed out and that were not assigned (the round moved on):
        the live ones are spares again."""
        self.spares.extend(w for w in workers if w.exit_code is None and w not in self.running)

    def finished(self) -> list[Worker]:
        """The round's workers all exited 0: forget them as running (they are gone); returns them."""
        done, self.running = self.running, []
        return done

    # -- stopping -------------------------------------------------------------------------------
    async def stop_running(self, grace: float) -> None:
        """Stop every assigned worker (and those started before admission): SIGTERM, then SIGKILL
        after ``grace`` (0: SIGKILL now)."""
        workers, self.running, self.early = [*self.running, *self.early], [], []
        await self._stop(workers, grace)

    async def wait_exited(self, workers: list[Worker], timeout: float) -> bool:
        """Wait until each of ``workers`` exited, at most ``timeout`` seconds; True if all did."""
        live = [w for w in workers if w.exit_code is None]
        if live:
            waits = [asyncio.ensure_future(w.exited.wait()) for w in live]
            try:
                await asyncio.wait(waits, timeout=timeout)
            finally:
                for f in waits:  # none left pending: a caller may wait in slices
                    f.cancel()
        return all(w.exited.is_set() for w in workers)

    async def wait_taken(self, workers: list[Worker], timeout: float) -> None:
        """Wait until each of ``workers`` took the round it was handed (or exited), at most ``timeout`` s."""
        await _each_or_exit(workers, lambda w: w.took_round, timeout)

    async def discard(self, workers: list[Worker]) -> None:
        """Kill workers taken for a round that cannot use them (one that never started)."""
        await self._stop(workers, 0.0)

    def cut_teardown(self, worker: Worker) -> None:
        """SIGKILL a worker whose work is done and whose teardown is stuck; its exit counts as success."""
        worker.teardown_cut = worker.stopping = True
        worker.proc.signal(signal.SIGKILL)

    def kill_running_now(self) -> None:
        """SIGKILL every assigned worker (and those started before admission) without waiting (fencing)."""
        for w in [*self.running, *self.early]:
            w.stopping = True
            w.proc.signal(signal.SIGKILL)

    async def _stop(self, workers: list[Worker], grace: float) -> None:
        for w in workers:
            w.stopping = True
        await stop([w.proc for w in workers], grace)

    async def close(self, grace: float) -> None:
        """Stop everything: running workers with ``grace``, spares and the template at once."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
        spares, self.spares = self.spares, []
        for w in spares:
            w.proc.close_control()
        await asyncio.gather(self.stop_running(grace), self._stop(spares, 0.0))
        tpl = self._template
        if tpl is not None:
            await stop([tpl.proc], 0.0)  # its exit clears self._template
            tpl.proc.cancel()
        for w in list(self._all):
            w.proc.cancel()


async def _each_or_exit(workers: list[Worker], event: Callable[[Worker], asyncio.Event], timeout: float) -> None:
    """Wait until, for each of ``workers``, ``event(worker)`` is set or the worker exited, at most
    ``timeout`` seconds in all."""

    async def one(w: Worker) -> None:
        events = [asyncio.ensure_future(event(w).wait()), asyncio.ensure_future(w.exited.wait())]
        try:
            await asyncio.wait(events, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for e in events:
                e.cancel()

    waits = [asyncio.ensure_future(one(w)) for w in workers if not (event(w).is_set() or w.exited.is_set())]
    if waits:
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for task in pending:
            task.cancel()


def _job(env: dict[str, str], script: str | None, module: str | None, argv: tuple[str, ...]) -> dict:
    """A worker's job, as its control pipe carries it (:mod:`ftrt.agents.workers._bootstrap` reads it)."""
    return {"env": env, "argv": list(argv), "script": os.path.abspath(script) if script else None,
            "module": module, "cwd": os.getcwd()}
