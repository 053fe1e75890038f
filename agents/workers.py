"""The worker processes of one node: warm spares, assignment, output, exits and stopping.

Every worker is a ``python -m ftrt.agents._bootstrap`` process (see that module for the wire
protocol). The pool keeps ``nproc`` spares warm (torch imported; the one meant for local rank 0
also holds a TCPStore server on a fresh port), hands them out for a round, and replaces them in
the background at idle CPU priority so a spare's warm-up does not slow the running workers.

Output: each worker's stdout and stderr lines go to the agent's stdout with a ``[rankN]:`` prefix
(``[warm]`` before assignment), and with a log directory also to ``round-R/rank-N.log``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from ftrt import _diag, envnames, reports
from ftrt.agents import template
from ftrt.agents.template import ForkedProc, TemplateError

log = logging.getLogger(__name__)

IDLE_WARM_GRACE = 2.0
"""The least time a replacement spare warms at SCHED_IDLE before it is moved to normal priority."""
IDLE_WARM_GRACE_MAX = 600.0
"""The most (see :func:`idle_warm_grace`)."""


def idle_warm_grace(change_interval_s: float) -> float:
    """Seconds a replacement spare may warm at SCHED_IDLE before it is boosted to normal priority,
    given the expected seconds until the job's membership next changes (a fault, or a node
    joining: either round needs warm spares).

    Boosting takes CPU from training on a machine that has none idle (one spare's warm-up is
    several CPU-seconds); not boosting risks a cold start if the next change comes before the
    spare is warm. A tenth of the expected interval, within [2 s, 600 s], keeps that risk near a
    tenth, while a job whose membership rarely changes warms its spares on idle CPU only.
    """
    return min(max(0.1 * change_interval_s, IDLE_WARM_GRACE), IDLE_WARM_GRACE_MAX)


def change_interval(mtbf_s: float, rounds: int, age_s: float) -> float:
    """Expected seconds between membership changes: the MTBF, or the job's observed mean time
    between rounds (faults and joins alike) when that is shorter."""
    observed = age_s / (rounds - 1) if rounds > 1 and age_s > 0 else float("inf")
    return min(mtbf_s, observed)

REFILL_PROGRESS_WAIT = 10.0
"""Longest wait for the running workers' first heartbeat before used spares are replaced."""

DEFAULT_WARM_IMPORTS = (
    "torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
    "torch.distributed.checkpoint", "ftrt.checkpoint.checkpointer", "ftrt.checkpoint.pointer",
)
"""What spares import while they wait. DDP and every torch.optim optimizer import torch._dynamo
on first use (2-3 s here), so a spare that skipped it would pay it after its assignment; a
restore needs DCP, ftrt's checkpointer and the etcd client (~0.3 s more here)."""


def warm_imports_for(module: str | None) -> tuple[str, ...]:
    """The default warm imports for a job run as ``-m module`` (None: a script).

    An ftrt module's package is imported too: ``runpy`` imports it anyway before it runs the
    module, and ftrt's packages read nothing from the environment at import (a worker's rank
    and round arrive after the spare imported them). A user's package may (say, a device chosen
    from ``LOCAL_RANK`` at import), so it is warm-imported only when named with ``--warm-import``.
    """
    if not module or module.split(".")[0] != "ftrt":
        return DEFAULT_WARM_IMPORTS
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return DEFAULT_WARM_IMPORTS
    if spec is None:
        return DEFAULT_WARM_IMPORTS
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    return (*DEFAULT_WARM_IMPORTS, package) if package and package != "ftrt" else DEFAULT_WARM_IMPORTS


@dataclass(eq=False)
class Spawned:
    """A bootstrap process just started (or forked from the template), not yet watched by an
    event loop."""

    popen: subprocess.Popen | ForkedProc
    control_fd: int
    report_fd: int
    hosts_store: bool
    spawned_at: float


def spawn_bootstrap(
    *,
    base_env: dict[str, str],
    fence_path: str,
    warm_imports: tuple[str, ...],
    hosts_store: bool,
    idle: bool,
    template_fd: int = -1,
) -> Spawned:
    """Start one ``ftrt.agents._bootstrap`` process (synchronous: a fork and an exec).

    The CLI calls this before it imports the agent's heavier modules, so a new node's spares
    start importing torch as early as possible; the pool adopts them once its loop runs.
    With ``template_fd`` (the template's end of :func:`template.socket_pair`), the process is a
    spare template instead (:mod:`ftrt.agents.template`); its control pipe is then unused.
    """
    ctl_r, ctl_w = os.pipe()
    rep_r, rep_w = os.pipe()
    env = dict(base_env)
    env.update({
        envnames.CONTROL_FD: str(ctl_r),
        envnames.REPORT_FD: str(rep_w),
        envnames.FENCE_FILE: fence_path,
        envnames.WARM_STORE: "1" if hosts_store else "0",
        envnames.WARM_IMPORTS: ",".join(warm_imports),
        envnames.WARM_IDLE: "1" if idle else "0",
        envnames.AGENT_PID: str(os.getpid()),
    })
    passed = [ctl_r, rep_w]
    if template_fd >= 0:
        env[template.ENV] = str(template_fd)
        passed.append(template_fd)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "ftrt.agents._bootstrap"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(passed),
            env=env,
            start_new_session=True,
        )
    except BaseException:
        for fd in (ctl_w, rep_r):
            os.close(fd)
        raise
    finally:
        os.close(ctl_r)
        os.close(rep_w)
    return Spawned(popen, ctl_w, rep_r, hosts_store, time.monotonic())


def spawn_template(*, base_env: dict[str, str], fence_path: str, warm_imports: tuple[str, ...],
                   idle: bool) -> tuple[Spawned, "socket.socket"]:
    """Start a spare template (:mod:`ftrt.agents.template`): the process and the agent's end of
    its request socket (synchronous, like :func:`spawn_bootstrap`)."""
    ours, theirs = template.socket_pair()
    try:
        spawned = spawn_bootstrap(base_env=base_env, fence_path=fence_path, warm_imports=warm_imports,
                                  hosts_store=False, idle=idle, template_fd=theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    os.close(spawned.control_fd)  # a template takes requests on its socket only
    spawned.control_fd = -1
    return spawned, ours


class WorkerState(str, enum.Enum):
    """A worker's life: ``warming -> warm -> running -> exited`` (a spare may exit from any state).
    The values are what ``ftrt status`` and the Status RPC show."""

    WARMING = "warming"
    WARM = "warm"
    RUNNING = "running"
    EXITED = "exited"


@dataclass(eq=False)
class Worker:
    """One worker process, warm or assigned."""

    proc: subprocess.Popen | ForkedProc
    control_fd: int
    hosts_store: bool
    spawned_at: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    store_port: int = 0
    state: WorkerState = WorkerState.WARMING
    local_rank: int = -1
    rank: int = -1
    round: int = 0
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
    """It polls the round-end file (:mod:`ftrt.agents.boundary`): a planned round waits for it."""
    assigned_at: float = 0.0
    exit_code: int | None = None
    stopping: bool = False
    log_file: IO[bytes] | None = None
    tasks: list = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def prefix(self) -> bytes:
        return f"[rank{self.rank}]: ".encode() if self.rank >= 0 else b"[warm]: "


class SpareTemplate:
    """The pool's template process (:mod:`ftrt.agents.template`) and its request socket."""

    def __init__(self, worker: Worker, sock: socket.socket) -> None:
        self.worker = worker
        self.sock = sock
        self.forked: dict[int, ForkedProc] = {}
        """Spares forked and not yet reported exited, by pid."""

    @property
    def usable(self) -> bool:
        return self.worker.state is WorkerState.WARM and self.worker.exit_code is None

    @property
    def warming(self) -> bool:
        return self.worker.state is WorkerState.WARMING and self.worker.exit_code is None

    def fork(self, hosts_store: bool) -> Spawned:
        """A warm spare, forked now (raises :class:`TemplateError`)."""
        proc, control_fd, report_fd = template.fork_spare(self.sock, hosts_store=hosts_store)
        self.forked[proc.pid] = proc
        return Spawned(proc, control_fd, report_fd, hosts_store, time.monotonic())

    def exited(self, pid: int, code: int) -> None:
        """The template reported that a spare it forked exited."""
        proc = self.forked.pop(pid, None)
        if proc is not None:
            proc.finished(code)

    def lost(self) -> None:
        """The template exited: its children die with it (``PR_SET_PDEATHSIG``); make sure of it
        and tell their waiters."""
        self.sock.close()
        for pid, proc in list(self.forked.items()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.finished(-signal.SIGKILL)
        self.forked.clear()


class WorkerPool:
    """Spawns, assigns, watches and stops this node's workers.

    Args:
        nproc: workers per round.
        fence_path: the agent's fence file, given to every worker.
        warm: keep spares warm; without it every start is cold.
        warm_imports: modules a spare imports while it waits.
        base_env: environment for workers (the agent's, plus anything the agent adds).
        on_exit: called as ``on_exit(worker)`` when an assigned worker exits.
        on_heartbeat: called as ``on_heartbeat(worker)`` on each heartbeat.
        on_memory: called as ``on_memory(rank, step)`` when a worker's memory checkpoint is complete.
        on_report: called as ``on_report(worker, report)`` with a worker's checkpoint, restore and
            trainer reports (:class:`~ftrt.reports.MemorySaved`, ``Committed``, ``Restored``, ``Stats``).
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
        self._all: set[Worker] = set()
        self._closed = False
        self._refill: asyncio.Task | None = None
        self._template: SpareTemplate | None = None
        """The running spare template, once a refill started one (None before, or after it failed)."""
        self._templates = warm and not _diag.off("template")
        """Whether replacement spares are forked from a template (off after a template failed)."""

    # -- spawning -------------------------------------------------------------------------------
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

    def _start_template(self, *, idle: bool) -> SpareTemplate:
        return self.adopt_template(*spawn_template(
            base_env=self.base_env, fence_path=self.fence_path, warm_imports=self.warm_imports, idle=idle))

    def adopt_template(self, spawned: Spawned, sock: socket.socket) -> SpareTemplate:
        """Watch a started spare template; spares are forked from it once it is warm."""
        tpl = SpareTemplate(self.adopt(spawned), sock)
        self._template = tpl
        log.info("spare template pid %d started: spares will be forked from it", tpl.worker.pid)
        return tpl

    async def _template_ready(self, idle_grace: float) -> None:
        """Start the template if there is none, and wait until it is warm (boosted after
        ``idle_grace`` seconds at idle priority) or gone."""
        if not self._templates:
            return
        tpl = self._template or self._start_template(idle=bool(self.running))
        try:
            await asyncio.wait_for(tpl.worker.ready.wait(), idle_grace)
        except asyncio.TimeoutError:
            _boost(tpl.worker)
            await tpl.worker.ready.wait()

    def adopt(self, spawned: Spawned) -> Worker:
        """Watch a started bootstrap process (output, reports, exit) as a spare."""
        worker = Worker(
            proc=spawned.popen, control_fd=spawned.control_fd, hosts_store=spawned.hosts_store,
            spawned_at=spawned.spawned_at,
        )
        self._all.add(worker)
        worker.tasks = [
            asyncio.create_task(self._pump(worker, spawned.popen.stdout)),
            asyncio.create_task(self._pump(worker, spawned.popen.stderr)),
            asyncio.create_task(self._reports(worker, spawned.report_fd)),
            asyncio.create_task(self._wait(worker)),
        ]
        return worker

    def adopt_spares(self, spawned: list[Spawned]) -> None:
        """Take over spares the CLI started before the event loop existed."""
        self.spares.extend(self.adopt(s) for s in spawned)

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
        if not self.warm or self._closed:
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
                        _boost(w)
                await self.spares_ready()
            log.info("spares warm again after %.1f s", time.monotonic() - t0)

        self._refill = asyncio.create_task(run())

    async def spares_ready(self) -> None:
        """Wait until every spare has reported ready (and the template they are forked from)."""
        await self._awaiting_template()
        for w in list(self.spares):
            await w.ready.wait()

    async def _awaiting_template(self, boost: bool = False) -> None:
        """If spares are missing and the template that fills them warms, wait for it (moved to
        normal priority if ``boost``)."""
        tpl = self._template
        if tpl is None or not tpl.warming or len(self.spares) >= self.nproc:
            return
        if boost:
            _boost(tpl.worker)
        await tpl.worker.ready.wait()
        self.fill_spares()  # a template that failed meanwhile: started directly

    @property
    def warm_count(self) -> int:
        return sum(1 for w in self.spares if w.ready.is_set() and w.exit_code is None)

    async def take(self) -> list[Worker]:
        """``nproc`` workers for a round, index 0 holding a TCPStore; cold-started if needed."""
        await self._awaiting_template(boost=True)
        alive = [w for w in self.spares if w.exit_code is None]
        store_holders = [w for w in alive if w.hosts_store]
        first = store_holders[0] if store_holders else self._spawn(hosts_store=True, idle=False)
        rest = [w for w in alive if w is not first][: self.nproc - 1]
        while len(rest) < self.nproc - 1:
            rest.append(self._spawn(hosts_store=False, idle=False))
        chosen = [first, *rest]
        self.spares = [w for w in self.spares if w not in chosen and w.exit_code is None]
        for w in chosen:
            if not w.ready.is_set():
                _boost(w)  # a spare still warming at idle priority is needed now
        return chosen

    # -- assignment -----------------------------------------------------------------------------
    def assign(self, worker: Worker, *, local_rank: int, rank: int, round_no: int, env: dict[str, str],
               script: str | None, module: str | None, argv: tuple[str, ...]) -> None:
        """Send the worker its job; it starts running the script as soon as it is warm."""
        worker.local_rank, worker.rank, worker.round = local_rank, rank, round_no
        worker.state = WorkerState.RUNNING
        worker.assigned_at = time.monotonic()
        if self.log_dir:
            path = Path(self.log_dir) / f"round-{round_no}" / f"rank-{rank}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            worker.log_file = open(path, "ab")
        message = {
            "env": env,
            "argv": list(argv),
            "script": os.path.abspath(script) if script else None,
            "module": module,
            "cwd": os.getcwd(),
        }
        data = (json.dumps(message) + "\n").encode()
        try:
            os.write(worker.control_fd, data)
        except OSError as exc:  # it died meanwhile: its exit is reported by _wait
            log.warning("could not hand rank %d to worker pid %d: %s", rank, worker.pid, exc)
        finally:
            os.close(worker.control_fd)
            worker.control_fd = -1
        self.running.append(worker)

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
        """Stop every assigned worker: SIGTERM, then SIGKILL after ``grace`` (0: SIGKILL now)."""
        workers, self.running = self.running, []
        await self._stop(workers, grace)

    async def wait_exited(self, workers: list[Worker], timeout: float) -> bool:
        """Wait until each of ``workers`` exited, at most ``timeout`` seconds; True if all did."""
        live = [w for w in workers if w.exit_code is None]
        if live:
            await asyncio.wait([asyncio.ensure_future(w.exited.wait()) for w in live], timeout=timeout)
        return all(w.exited.is_set() for w in workers)

    async def discard(self, workers: list[Worker]) -> None:
        """Kill workers taken for a round that cannot use them (one that never started)."""
        await self._stop(workers, 0.0)

    def cut_teardown(self, worker: Worker) -> None:
        """SIGKILL a worker whose work is done and whose teardown is stuck; its exit counts as success."""
        worker.teardown_cut = worker.stopping = True
        _signal_group(worker, signal.SIGKILL)

    def kill_running_now(self) -> None:
        """SIGKILL every assigned worker without waiting (fencing)."""
        for w in self.running:
            w.stopping = True
            _signal_group(w, signal.SIGKILL)

    async def _stop(self, workers: list[Worker], grace: float) -> None:
        live = [w for w in workers if w.exit_code is None]
        for w in live:
            w.stopping = True
            _signal_group(w, signal.SIGKILL if grace <= 0 else signal.SIGTERM)
        if grace > 0 and live:
            await asyncio.wait([asyncio.ensure_future(w.exited.wait()) for w in live], timeout=grace)
            for w in live:
                if not w.exited.is_set():
                    _signal_group(w, signal.SIGKILL)
        await asyncio.gather(*(w.exited.wait() for w in live), return_exceptions=True)
        # Grandchildren in the worker's process group die with it.
        for w in live:
            _signal_group(w, signal.SIGKILL)

    async def close(self, grace: float) -> None:
        """Stop everything: running workers with ``grace``, spares at once."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
        spares, self.spares = self.spares, []
        for w in spares:
            if w.control_fd >= 0:
                os.close(w.control_fd)
                w.control_fd = -1
        await asyncio.gather(self.stop_running(grace), self._stop(spares, 0.0))
        if self._template is not None:
            await self._stop([self._template.worker], 0.0)
        for w in list(self._all):
            for t in w.tasks:
                if not t.done():
                    t.cancel()
            if w.log_file:
                w.log_file.close()

    # -- background readers ---------------------------------------------------------------------
    async def _pump(self, worker: Worker, pipe: IO[bytes]) -> None:
        stream = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), pipe
        )
        try:
            await self._pump_lines(worker, stream)
        finally:
            transport.close()

    async def _pump_lines(self, worker: Worker, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stream.readline()
            except (ValueError, asyncio.LimitOverrunError):
                line = await stream.read(65536)
            if not line:
                return
            if not line.endswith(b"\n"):
                line += b"\n"
            self.out.write(worker.prefix + line)
            self.out.flush()
            if worker.log_file is not None:
                worker.log_file.write(line)
                worker.log_file.flush()

    async def _reports(self, worker: Worker, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
        )
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                match reports.decode(line):
                    case reports.Heartbeat(step=step):
                        now = time.monotonic()
                        if worker.last_heartbeat is not None and step > worker.step >= 0:
                            worker.step_interval = (now - worker.last_heartbeat) / (step - worker.step)
                        worker.step, worker.last_heartbeat = step, now
                        if self.on_heartbeat is not None:
                            self.on_heartbeat(worker)
                    case reports.Done(step=step):
                        if worker.done_at is None:
                            worker.done_at = time.monotonic()
                            log.info("rank %d is done (step %s); its teardown is not judged for hangs",
                                     worker.rank, step)
                    case reports.Boundary():
                        worker.polls_boundary = True
                    case reports.SpareExit(pid=pid, code=code):
                        if self._template is not None and worker is self._template.worker:
                            self._template.exited(pid, code)
                    case reports.MemorySaved() as saved:
                        if self.on_memory is not None:
                            self.on_memory(saved.rank, saved.step)
                        if self.on_report is not None:
                            self.on_report(worker, saved)
                    case reports.Committed() | reports.Restored() | reports.Stats() as other:
                        if self.on_report is not None:
                            self.on_report(worker, other)
                    case reports.Ready(store_port=port):
                        worker.store_port = port
                        if worker.state is WorkerState.WARMING:
                            worker.state = WorkerState.WARM
                        worker.ready.set()
                        if self._template is not None and worker is self._template.worker:
                            self.fill_spares()
        finally:
            transport.close()

    async def _wait(self, worker: Worker) -> None:
        code = await _exit_code(worker.proc)
        worker.exit_code = code
        worker.exited.set()
        worker.ready.set()  # nobody waits forever on a dead spare
        if self._template is not None and worker is self._template.worker:
            self._template.lost()
            self._template = None
            if not self._closed:
                log.warning("the spare template pid %d exited with code %s; spares start directly from now on",
                            worker.pid, code)
                self._templates = False
        if worker in self.spares:
            self.spares.remove(worker)
            if not self._closed:
                log.warning("spare worker pid %d exited with code %s while warm", worker.pid, code)
                self.refill_later(1.0)
        previous = worker.state
        worker.state = WorkerState.EXITED
        if worker.control_fd >= 0:
            os.close(worker.control_fd)
            worker.control_fd = -1
        if previous is WorkerState.RUNNING and not worker.stopping:
            self.on_exit(worker)
        self._all.discard(worker)
        # Let the output pumps drain before closing the log file.
        await asyncio.gather(*worker.tasks[:2], return_exceptions=True)
        if worker.log_file is not None:
            worker.log_file.close()
            worker.log_file = None


async def _exit_code(proc: subprocess.Popen | ForkedProc) -> int:
    """Wait for a child's exit without a thread: its pidfd turns readable when it exits. A
    forked spare's code comes from its template."""
    if isinstance(proc, ForkedProc):
        return await proc.wait_exit()
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return await asyncio.to_thread(proc.wait)
    done = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()


def _boost(worker: Worker) -> None:
    """Move every thread of a warming spare from SCHED_IDLE back to normal scheduling."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{worker.pid}/task")]
    except OSError:
        tids = [worker.pid]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):
            pass


def _signal_group(worker: Worker, sig: int) -> None:
    try:
        os.killpg(worker.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
