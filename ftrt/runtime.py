"""The worker-side embedding API: ``rt = ftrt.init()``.

Inside a worker started by ``ftrt launch`` it reads the rank, world and round from the
environment and reports progress to the node's agent (``rt.heartbeat(step)``: cheap, never
blocks, used for hang detection and status). Under plain torchrun it reads torchrun's variables
and heartbeats go nowhere; run as a plain script it is a world of one. Code written against it
therefore runs unchanged in all three settings.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ftrt import _diag, envnames, reports
from ftrt.errors import FtrtError, WorldChanged

if TYPE_CHECKING:
    from ftrt.control import ControlChannel, NewRound
    from ftrt.roundendfile import RoundEndReader
    from ftrt.checkpoint.cadence import Cadence, Choice, Interval
    from ftrt.store.access import EtcdTarget
    from ftrt.store.sync import SyncStore


def _env_num(name: str, default, cast):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        kind = "an integer" if cast is int else "a number"
        raise ValueError(f"Environment variable {name}={raw!r} is not {kind}.") from None


def _env_int(name: str, default: int) -> int:
    return _env_num(name, default, int)


def _env_float(name: str, default: float) -> float:
    return _env_num(name, default, float)


@dataclass
class Runtime:
    """What a worker knows about its place in the job. Build it with :func:`ftrt.init`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    round: int = 0
    """Rendezvous round this worker runs in (0 outside ftrt)."""
    restart_count: int = 0
    job_id: str = "local"
    node_id: str = "local"
    agent_addr: str = ""
    launched_by_ftrt: bool = False
    faults: int = 0
    """Faults the job has had so far (lost nodes, worker failures; 0 outside ftrt)."""
    job_started: float = 0.0
    """Wall time the job's first round started (0 outside ftrt: then this process's start)."""
    mtbf: float | None = None
    """The MTBF the operator configured (``ftrt launch --mtbf``), or None."""
    min_nodes: int = 1
    """The fewest nodes the job runs with (``ftrt launch --nnodes MIN``; 1 outside ftrt)."""
    etcd: "EtcdTarget | None" = None
    """The job's etcd under ``ftrt launch`` (endpoints and access, as the agent handed them down);
    None elsewhere. Code that needs it calls :meth:`etcd_store`."""
    recovery: str = "restart"
    """``in-place`` when this worker may change rounds without exiting (``ftrt launch --recovery``,
    the default there), else ``restart``."""
    reconfigure_timeout: float = 10.0
    """Seconds to wait for the agent's next round after a step failed (``--reconfigure-timeout``)."""
    pending: bool = False
    """Started before its node was admitted to a running job (a join, under ``--recovery in-place``):
    its rank, world size and round are known only once :meth:`init_process_group` returns."""
    last_step: int = -1
    _report_fd: int = field(default=-1, repr=False)
    _control: "ControlChannel | None" = field(default=None, repr=False)  # under ftrt launch
    _group: "tuple[str | None, dict[str, Any]] | None" = field(default=None, repr=False)  # init_process_group's
    _round_end: "RoundEndReader | None" = field(default=None, repr=False)  # under ftrt launch
    _polls_round_end: bool = field(default=False, repr=False)  # told the agent (first round_ending())
    _joins_agreed: bool = field(default=False, repr=False)  # step(agreed_joins=True): ranks agreed on a join
    _steps_through_joins: bool = field(default=False, repr=False)  # inside step(agreed_joins=True)

    def heartbeat(self, step: int) -> None:
        """Tell the agent this worker reached ``step``. Non-blocking; a no-op outside ftrt.

        After the first heartbeat, a worker silent for longer than the agent's ``--hang-timeout``
        is treated as hung: killed and the round restarted.
        """
        self.last_step = int(step)
        if _diag.off("heartbeat"):
            return
        self.report(reports.Heartbeat(self.last_step))

    def done(self) -> None:
        """Tell the agent this worker finished its work; what follows is teardown (a final barrier,
        destroying the process group, the interpreter joining threads, a last log write).

        Hang detection stops judging this worker: its teardown may be silent for longer than
        ``--hang-timeout`` without failing the round. Its exit code still counts. Call it after the
        last checkpoint is closed. Non-blocking; a no-op outside ftrt.
        """
        self.report(reports.Done(self.last_step))

    def round_ending(self) -> bool:
        """Whether this worker's agent asked its round to end at the next step boundary.

        A node is joining: the job's state is intact, and rather than being killed mid-step this
        worker may finish its step, save a checkpoint of it and exit (any exit code), so that the
        new round resumes from that step with nothing redone. Data-parallel ranks must agree on
        the step first, since each sees the request at its own moment: e.g. add
        ``float(rt.round_ending())`` to a tensor the step already all-reduces and stop when the
        sum is positive, as the GRPO trainer does. Cheap (one read of mapped memory); call it
        once per step.

        The first call tells the agent that this worker polls; the agent then waits for it (at
        most a few steps) before it starts the new round. A worker that never calls it is
        stopped at once, as before. Outside ``ftrt launch`` this is always False.
        """
        if self._round_end is None:
            return False
        if not self._polls_round_end:
            self._polls_round_end = True
            self.report(reports.Boundary())
        return self._round_end.ending(self.round)

    def round_ends_after(self, step: int) -> None:
        """Tell the agent that this worker, asked to end its round (:meth:`round_ending`), ends it
        only after step ``step``, its trainer's next natural boundary, not after the step in
        progress: e.g. the end of a generation window, the first step whose checkpoint a round of
        another world size can resume without redoing steps. The agent then waits for those steps
        too (at their measured pace, at most :data:`ftrt.agents.workers.boundary.DEFERRED_WAIT_MAX`
        seconds, and on a draining node no longer than ``--drain-timeout``); past that it stops
        the workers as for a fault. Call it once, on every rank, with the same step. A no-op
        outside ``ftrt launch``."""
        if self._round_end is not None:
            self.report(reports.BoundaryAt(self.round, int(step)))

    def round_end_durable(self) -> bool:
        """Whether the round that :meth:`round_ending` ends must be saved to storage, not only in
        memory: the next round is inactive (a drain took the job below its minimum, or every node
        is leaving, e.g. at a time limit), so no memory copy would outlive the nodes. Agree on it
        as on :meth:`round_ending`. Outside ``ftrt launch`` always False."""
        return self._round_end is not None and self._round_end.durable(self.round)

    def draining(self) -> bool:
        """Whether this worker's node is leaving the job gracefully (SIGTERM to its agent, a
        preemption notice, ``ftrt drain``).

        The agent has asked for a round without this node; when it is written, every rank's
        :meth:`round_ending` turns True and the job ends the round at a step boundary as for a
        join (save the step, exit), then goes on without this node from that step. Until then
        this worker runs as usual: use the notice to get ready (finish an asynchronous save, stop
        taking new work). Cheap (one read of mapped memory). Outside ``ftrt launch`` always False.
        """
        return self._round_end is not None and self._round_end.draining()

    def exit_for_round(self) -> None:
        """End this worker now, after its round ended at a step boundary and its state is saved.

        Flushes stdout and stderr and leaves with ``os._exit(0)``: the interpreter's usual
        teardown (torch's, the checkpointer's threads) takes about a second here, and the next
        round, the whole job's, waits for this process to be gone. Call it only once every save
        the next round needs has completed.
        """
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    # -- changing rounds in place (ftrt.inplace) -------------------------------------------------
    def init_process_group(self, backend: str | None = None, **kwargs: Any) -> None:
        """``torch.distributed.init_process_group`` for this worker's round, kept across rounds.

        Under ``ftrt launch`` the group meets in the round's TCPStore under the round's own prefix
        (:func:`ftrt.inplace.round_store`), and with ``--recovery in-place`` (the default) this
        worker is from then on kept when the job's membership changes: it gets the new round from
        its agent (see :meth:`step`, :meth:`reconfigure`) instead of being restarted. Elsewhere
        (torchrun, a plain script) it is ``init_process_group(backend, **kwargs)`` unchanged.
        ``kwargs``: ``timeout`` (a ``timedelta``), ``device_id``, ``pg_options``...; not ``store``,
        ``rank`` or ``world_size``, which the round gives.

        A worker of a node that joins a running job whose workers change rounds in place is started
        before its node is admitted (:attr:`pending`): what the script does before this call (build
        and compile the model, warm it up on a dummy batch, start an inference engine) is done before
        the running ranks wait for it. The call then tells the agent the worker is ready, and returns
        once the round admitting the node came and its group is up. Read the rank and world size
        after it; ``LOCAL_RANK`` is set before.
        """
        import torch.distributed as dist

        if not self.launched_by_ftrt:
            dist.init_process_group(backend, **kwargs)
            return
        for taken in ("store", "rank", "world_size", "init_method"):
            if taken in kwargs:
                raise ValueError(f"Runtime.init_process_group takes no {taken}=: the round gives it.")
        self._group = (backend, dict(kwargs))
        if self.pending:
            if not self.in_place:
                raise FtrtError("This worker was started before its node was admitted, but it cannot change "
                                "rounds in place (no control pipe, or --recovery restart); its agent should not "
                                "have started it early.")
            self.report(reports.InPlace())  # warmed up: the agent may now let its node be admitted
            self._take_round(self._admission())
            return
        self._join_group()
        if self.in_place:
            self.report(reports.InPlace())

    @property
    def in_place(self) -> bool:
        """Whether this worker changes rounds without exiting (after :meth:`init_process_group`,
        under ``ftrt launch --recovery in-place``)."""
        return self._control is not None and self._group is not None and self.recovery == "in-place"

    def world_changed(self) -> bool:
        """Whether the agent has handed this worker a new round it has not taken yet (cheap: one
        non-blocking read). Always False when not :attr:`in_place`."""
        return self.in_place and self._control.poll() is not None  # type: ignore[union-attr]

    def join_waiting(self) -> bool:
        """Whether the round waiting for this worker only adds members to its own (a join, no fault
        since): the ranks of this round lose no peer, so they may finish a step first (see
        :meth:`step`'s ``agreed_joins``). Cheap, as :meth:`world_changed`."""
        return self.in_place and self._only_adds(self._control.poll())  # type: ignore[union-attr]

    def join_after_step(self) -> None:
        """The ranks agreed that a join waits (the step's collective summed :meth:`join_waiting`
        to more than zero): every rank takes the new round at the next :meth:`step`'s start."""
        self._joins_agreed = True

    def _only_adds(self, new: "NewRound | None") -> bool:
        return new is not None and new.adds_to == self.round

    @contextlib.contextmanager
    def step(self, *, agreed_joins: bool = False) -> Iterator[None]:
        """Run one training step; raise :class:`ftrt.WorldChanged` if the world changed under it.

        On entry: when a new round is waiting (a node joined, or left gracefully). On a
        ``RuntimeError`` inside (a collective whose peer died): when the agent hands over a new
        round within ``--reconfigure-timeout``; otherwise the error was the step's own and is
        raised unchanged. Catch :class:`~ftrt.WorldChanged`, call :meth:`reconfigure` and
        :func:`ftrt.sync_state`, and train the step again. When not :attr:`in_place` it only runs
        the step.

        ``agreed_joins=True``: a join (:meth:`join_waiting`) does not end the step in flight, whose
        collectives can still complete, so nothing is trained again. The ranks must then agree on
        the step after which they all take it, since one that took it at a step's start would
        leave a peer waiting inside that step's collective: add :meth:`join_waiting` (as 0 or 1)
        into a collective every rank runs in each step (e.g. the sum of the step's loss), and call
        :meth:`join_after_step` where the sum is not zero. The next ``step()`` raises
        ``WorldChanged`` on every rank alike. A round that drops a member (a fault, a drain)
        still ends the step at once."""
        pending = self._control.poll() if self.in_place else None  # type: ignore[union-attr]
        if self._joins_agreed or (pending is not None and not (agreed_joins and self._only_adds(pending))):
            number = pending.round if pending is not None else "the next"
            raise WorldChanged(f"Round {number} replaced round {self.round} at a step boundary.")
        self._steps_through_joins = agreed_joins
        try:
            yield
        except RuntimeError as exc:
            if not self.in_place:
                raise
            if self.draining():  # the others went on without this node: no round will come
                raise WorldChanged(f"This node is leaving the job; round {self.round} went on without it: {exc}") from exc
            new = self._control.wait(self.reconfigure_timeout)  # type: ignore[union-attr]
            if new is None:
                raise
            raise WorldChanged(f"Round {new.round} replaced round {self.round} during a step: {exc}") from exc
        finally:
            self._steps_through_joins = False

    def wait(self, work: Any) -> None:
        """Wait for an asynchronous collective (``dist.all_reduce(t, async_op=True)``), but leave it
        when this worker's agent hands over a new round: raise :class:`ftrt.WorldChanged` then.

        A collective whose peer is frozen (SIGSTOP, a hung host) neither completes nor fails on
        gloo, and ``abort()`` does not free it; a bounded wait does. Here the wait is cut in slices
        of :data:`ftrt.inplace.WAIT_SLICE_S`, between which the control pipe is read (one
        non-blocking read). On a node that is leaving it also ends once the round without it is
        written (the other ranks went on). When not :attr:`in_place` it is ``work.wait()``."""
        if not self.in_place:
            work.wait()
            return
        from ftrt.inplace import wait_leaving

        wait_leaving(work, self._gone)

    def _gone(self) -> str | None:
        """Why this worker's round went on without it, or None: a new round waits for it, or its node
        is leaving and the round without it is written (its agent asks the round to end)."""
        new = self._control.poll()  # type: ignore[union-attr]
        if new is not None and not (self._steps_through_joins and self._only_adds(new)):
            return f"Round {new.round} replaced round {self.round}"
        if self.draining() and self.round_ending():
            return f"This node is leaving the job; round {self.round} went on without it"
        return None

    def reconfigure(self, timeout: float | None = None) -> int:
        """Take the new round in place: wait for it (at most ``timeout`` s, default
        ``--reconfigure-timeout``), destroy the old default process group, take the new rank, world
        size and round, and make the new group with the same backend and options. Returns the new
        round. Rebuild what wraps the group afterwards (DDP), after :func:`ftrt.sync_state`.

        On a node that is leaving (:meth:`draining`) there is no next round for this worker: it
        ends here, as :meth:`exit_for_round` (exit code 0)."""
        if not self.in_place:
            raise FtrtError("Runtime.reconfigure works only under ftrt launch --recovery in-place, after "
                            "rt.init_process_group(); restart the worker instead.")
        if self.draining():
            self.exit_for_round()
        control = self._control
        wait = self.reconfigure_timeout if timeout is None else timeout
        if control.poll() is None:  # type: ignore[union-attr]
            control.wait(wait)  # type: ignore[union-attr]
        new = control.take()  # type: ignore[union-attr]
        if new is None:
            raise FtrtError(f"No new round came from this worker's agent within {wait:g} s "
                            "(--reconfigure-timeout); the agent may be gone.")
        import torch.distributed as dist

        if dist.is_initialized():
            from ftrt.inplace import leave_group

            leave_group()
        self._take_round(new)
        return self.round

    def _admission(self) -> "NewRound":
        """Wait for the round that admits this worker's node (:attr:`pending`); the agent stops this
        worker if its node leaves first."""
        control = self._control
        while (new := control.take()) is None:  # type: ignore[union-attr]
            if control.closed:  # type: ignore[union-attr]
                raise FtrtError("This worker's agent closed its control pipe before its node was admitted to "
                                "the job; the agent is gone.")
            control.wait(60.0)  # type: ignore[union-attr]
        return new

    def _take_round(self, new: "NewRound") -> None:
        """Run in round ``new`` from now on: its environment and place, its process group, and the
        agent told (:class:`~ftrt.reports.Reconfigured`)."""
        os.environ.update(new.env)
        for name, value in _placement().items():
            setattr(self, name, value)
        self.job_started = _env_float(envnames.JOB_STARTED, 0.0) or self.job_started
        self.pending = False
        self._joins_agreed = False
        self._join_group()
        self.report(reports.Reconfigured(self.round))

    def _join_group(self) -> None:
        """Make the default process group of this worker's round (:meth:`init_process_group`)."""
        import torch.distributed as dist
        from ftrt.inplace import round_store

        backend, kwargs = self._group  # type: ignore[misc]
        timeout = kwargs.get("timeout")
        wait = timeout.total_seconds() if timeout is not None else 300.0
        store = round_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.round, wait)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, **kwargs)

    def report_metrics(self, **values: float) -> None:
        """Publish training metrics (e.g. ``reward=0.41, kl=0.002``) on this node's Prometheus
        endpoint (``ftrt launch --metrics-port``) as ``ftrt_trainer_<name>`` gauges. Names are
        lower-case letters, digits and ``_`` (at most 48 characters, 32 names a job); call it from
        one rank (rank 0) once a step or less. Non-blocking; a no-op outside ftrt."""
        self.report(reports.Stats({name: float(value) for name, value in values.items()}))

    def report(self, message: reports.Report) -> None:
        """Send one report (:mod:`ftrt.reports`) to the agent (non-blocking; dropped if the agent is
        behind)."""
        if self._report_fd < 0:
            return
        try:
            os.write(self._report_fd, reports.encode(message))
        except BlockingIOError:
            pass  # the agent is behind; a dropped beat is harmless
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.EBADF):
                self._report_fd = -1  # the agent is gone; the fence watchdog will stop us
            else:
                raise

    def etcd_store(self) -> "SyncStore | None":
        """The job's etcd for this worker's synchronous code, shared by all its users (the checkpoint
        pointer, the rollout fleet): one connection on one event-loop thread, opened on first use
        and kept for the process's life. None outside ``ftrt launch``."""
        if self.etcd is None:
            return None
        from ftrt.store.sync import shared

        return shared(self.etcd)

    def checkpointer(self, url: str, keep: int = 3, storage_options: dict | None = None, **kwargs):
        """A :class:`ftrt.checkpoint.Checkpointer` wired to this job.

        Under ``ftrt launch`` its commits also move the job's ``latest`` pointer in etcd, fenced by
        this worker's round, and restore ignores checkpoints newer than that pointer; its saves
        also go to the node's memory tier; and its reports go to the agent (:meth:`report`), which
        replicates the memory checkpoints to peer nodes and counts them in its metrics. Elsewhere
        it is a plain Checkpointer. Every rank must call this alike (it creates a process group).

        In place, a checkpointer belongs to one round (its process groups come from that round's,
        its commits are fenced by it): after :meth:`reconfigure`, ``ck.retire()`` the old one (its
        save in flight is given up, never committed) and call this again on every rank.
        """
        from ftrt.checkpoint import Checkpointer
        from ftrt.checkpoint.pointer import job_pointer

        if "fence" not in kwargs:
            kwargs["fence"] = job_pointer(url)
        if self.launched_by_ftrt and os.environ.get(envnames.MEM_DIR):
            kwargs.setdefault("mem_dir", os.environ[envnames.MEM_DIR])
        kwargs.setdefault("report", self.report)
        if self.in_place:
            kwargs.setdefault("wait", self.wait)  # its vote leaves a frozen peer's collective
        if "key" not in kwargs:
            from ftrt.checkpoint.signing import load_key

            kwargs["key"] = load_key()  # the launcher's --checkpoint-key-file, or $FTRT_CHECKPOINT_KEY
        return Checkpointer(url, keep, storage_options, **kwargs)

    def cadence(self, name: str, interval: "Interval", *, max_interval_s: float, mtbf: float | None = None,
                on_choice: "Callable[[str, Choice], None] | None" = None,
                behind_memory: bool = False, behind_peers: bool = False) -> "Cadence":
        """A :class:`ftrt.checkpoint.cadence.Cadence` for one checkpoint tier of this job.

        ``interval`` is a number of steps or ``"auto"``; ``mtbf`` (seconds) overrides the
        launcher's ``--mtbf``; without either, the MTBF is observed from the job's faults
        (:func:`~ftrt.checkpoint.cadence.estimate_mtbf`). Feed it agreed numbers on every rank.
        ``on_choice(name, choice)`` hears each new interval (default: a log line).

        ``behind_memory``: the tier is a storage tier behind a memory tier that recovers a node's
        loss, so it plans for losses of every in-memory copy instead of for every fault: ``mtbf``
        then means their MTBF and the launcher's ``--mtbf`` does not apply. The job's faults are
        not such losses, so the fault counts :meth:`Cadence.update` gets are not used: without
        ``mtbf`` it plans for the prior, or for the job's age once longer.

        ``behind_peers``: the tier is a memory tier behind ranks that recover a lost node or worker
        in place, each holding the whole state; it plans for the faults they do not recover (every
        rank lost at once, a fallback to a restore or a restart): the counts :meth:`Cadence.update`
        gets must be of those (e.g. the trainer's restores), and ``mtbf``, when given, is their MTBF.
        """
        from ftrt.checkpoint.cadence import IN_PLACE_MISS, MEMORY_LOSS, Cadence, estimate_mtbf

        if behind_memory:
            return Cadence(name, interval, max_interval_s=max_interval_s,
                           mtbf=lambda faults, elapsed: estimate_mtbf(mtbf, 0, elapsed, counted=MEMORY_LOSS),
                           on_choice=on_choice)
        if behind_peers:
            return Cadence(name, interval, max_interval_s=max_interval_s,
                           mtbf=lambda misses, elapsed: estimate_mtbf(mtbf, misses, elapsed, counted=IN_PLACE_MISS),
                           on_choice=on_choice)
        configured = mtbf if mtbf is not None else self.mtbf
        return Cadence(name, interval, max_interval_s=max_interval_s,
                       mtbf=lambda faults, elapsed: estimate_mtbf(configured, faults, elapsed),
                       on_choice=on_choice)

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


_RUNTIME: Runtime | None = None


def _round_end_reader() -> "RoundEndReader | None":
    """The agent's round-end file, mapped, when ``ftrt launch`` started this worker."""
    from ftrt.roundendfile import RoundEndReader

    path = os.environ.get(envnames.ROUND_END_FILE)
    return RoundEndReader(path) if path and envnames.JOB_ID in os.environ else None


def _etcd_target() -> "EtcdTarget | None":
    """The job's etcd, when ``ftrt launch`` started this worker and named one."""
    if envnames.JOB_ID not in os.environ:
        return None
    from ftrt.store.access import target_from_env

    return target_from_env()


def _placement() -> dict[str, Any]:
    """What the environment says about this worker's place in its round (it changes with the round
    when the worker changes rounds in place)."""
    return dict(
        rank=_env_int("RANK", 0),
        world_size=_env_int("WORLD_SIZE", 1),
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        group_rank=_env_int("GROUP_RANK", 0),
        round=_env_int(envnames.ROUND, 0),
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        faults=_env_int(envnames.FAULTS, 0),
    )


def _control_channel() -> "ControlChannel | None":
    """The agent's control pipe, when ``ftrt launch`` started this worker (next rounds come there)."""
    fd = _env_int(envnames.CONTROL_FD, -1)
    if fd < 0 or envnames.JOB_ID not in os.environ:
        return None
    from ftrt.control import ControlChannel

    return ControlChannel.open(fd, after=_env_int(envnames.ROUND, 0))


def init() -> Runtime:
    """Return this process's :class:`Runtime` (created on first call from the environment)."""
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    fd = _env_int(envnames.REPORT_FD, -1)
    if fd >= 0:
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        except OSError:
            fd = -1
    _RUNTIME = Runtime(
        **_placement(),
        job_id=os.environ.get(envnames.JOB_ID) or os.environ.get("TORCHELASTIC_RUN_ID") or "local",
        node_id=os.environ.get(envnames.NODE_ID, "local"),
        agent_addr=os.environ.get(envnames.AGENT_ADDR, ""),
        launched_by_ftrt=envnames.JOB_ID in os.environ,
        job_started=_env_float(envnames.JOB_STARTED, 0.0) or time.time(),
        mtbf=_env_float(envnames.MTBF, 0.0) or None,
        min_nodes=max(_env_int(envnames.MIN_NODES, 1), 1),
        etcd=_etcd_target(),
        recovery=os.environ.get(envnames.RECOVERY) or "restart",
        reconfigure_timeout=_env_float(envnames.RECONFIGURE_TIMEOUT, 10.0),
        pending=os.environ.get(envnames.ADMISSION) == "pending",
        _report_fd=fd,
        _control=_control_channel(),
        _round_end=_round_end_reader(),
    )
    return _RUNTIME
