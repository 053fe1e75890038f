"""Worker processes, below any notion of ranks or rounds: start one, pump its output, read its
reports, talk to it, signal it, reap it. Like torch elastic's ``start_processes() -> PContext``;
:mod:`ftrt.agents.workers.pool` assigns ranks and rounds on top.

Every worker is a ``python -m ftrt.agents.workers._bootstrap`` process (see that module for the
wire protocol), started directly (:func:`spawn_bootstrap`) or forked from the spare template
(:mod:`ftrt.agents.workers.template`). Started synchronously (the CLI starts the first spares
before any event loop exists), a process becomes a :class:`Proc` once the agent's loop watches it:

- its stdout and stderr lines go to the agent's stdout with a prefix (``[warm]: `` until it is
  given a rank, then ``[rankN]: ``), and to a per-round log file when there is one;
- its report pipe is decoded line by line (:func:`ftrt.reports.decode`) and handed on;
- its control pipe carries the agent's messages to it (one JSON line each: the assignment, then
  the rounds a worker kept in place takes, :mod:`ftrt.control`);
- its exit is awaited without a thread (a pidfd; a forked spare's code comes from its template).

A process is in its own process group: signals go to the group, so its children go with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from ftrt import envnames, reports

WARM_PREFIX = b"[warm]: "


@dataclass(eq=False)
class ForkedProc:
    """A spare forked by the template, as the pool sees it (in place of a ``subprocess.Popen``).

    The agent is not its parent: its return code arrives in the template's report
    (:meth:`finished`).
    """

    pid: int
    stdout: IO[bytes]
    stderr: IO[bytes]
    returncode: int | None = None
    _waiters: list = field(default_factory=list)

    def finished(self, code: int) -> None:
        """Record the return code the template reported."""
        if self.returncode is None:
            self.returncode = code
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(self.returncode)
        self._waiters.clear()

    async def wait_exit(self) -> int:
        """Wait for :meth:`finished`; the return code."""
        if self.returncode is not None:
            return self.returncode
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return await fut


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
    """Start one bootstrap process (synchronous: a fork and an exec).

    The CLI calls this before it imports the agent's heavier modules, so a new node's spares
    start importing torch as early as possible; the pool adopts them once its loop runs.
    With ``template_fd`` (the template's end of :func:`~ftrt.agents.workers.template.socket_pair`),
    the process is a spare template instead; its control pipe is then unused.
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
        env[envnames.TEMPLATE_FD] = str(template_fd)
        passed.append(template_fd)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "ftrt.agents.workers._bootstrap"],
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


class Proc:
    """One bootstrap process that the running event loop watches (see the module docstring).

    ``on_report(report)`` hears each report it sends; ``on_exit()`` is called once it has exited
    (:attr:`exit_code` set), before its remaining output is drained."""

    def __init__(self, spawned: Spawned, *, out: IO[bytes], on_report: Callable[[reports.Report], None],
                 on_exit: Callable[[], None]) -> None:
        self.popen = spawned.popen
        self.pid = spawned.popen.pid
        self.hosts_store = spawned.hosts_store
        self.spawned_at = spawned.spawned_at
        self.exit_code: int | None = None
        self.exited = asyncio.Event()
        self.prefix = WARM_PREFIX
        """What its output lines start with on the agent's stdout."""
        self._control_fd = spawned.control_fd
        self._out = out
        self._log: IO[bytes] | None = None
        self._on_report = on_report
        self._on_exit = on_exit
        self._pumps = [asyncio.create_task(self._pump(spawned.popen.stdout)),
                       asyncio.create_task(self._pump(spawned.popen.stderr))]
        self._tasks = [*self._pumps, asyncio.create_task(self._read_reports(spawned.report_fd)),
                       asyncio.create_task(self._wait())]

    # -- the agent's side of the conversation ---------------------------------------------------
    def send(self, message: dict) -> bool:
        """Write one message (a JSON line) on its control pipe; False if it can no longer hear it
        (it exited: its exit is reported as usual)."""
        return self.send_line((json.dumps(message) + "\n").encode())

    def send_line(self, line: bytes) -> bool:
        """Write one encoded line on its control pipe (:meth:`send`)."""
        if self._control_fd < 0:
            return False
        try:
            os.write(self._control_fd, line)
            return True
        except OSError:
            return False

    def close_control(self) -> None:
        """Close its control pipe: a spare that reads the end of it exits 0 (it is not needed)."""
        if self._control_fd >= 0:
            os.close(self._control_fd)
            self._control_fd = -1

    def log_to(self, path: str, prefix: bytes) -> None:
        """From now on, its output lines start with ``prefix`` and are also appended to ``path``
        (instead of the file before, a worker that took a new round in place)."""
        self.prefix = prefix
        if self._log is not None:
            self._log.close()
        self._log = open(path, "ab")

    # -- signals --------------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Signal its process group (it and its children); nothing if it is gone."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def boost(self) -> None:
        """Move every thread of a process warming at SCHED_IDLE back to normal scheduling."""
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except OSError:
            tids = [self.pid]
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except (AttributeError, OSError):
                pass

    def cancel(self) -> None:
        """Stop watching it (the agent is closing)."""
        for t in self._tasks:
            if not t.done():
                t.cancel()
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- background readers ---------------------------------------------------------------------
    async def _pump(self, pipe: IO[bytes]) -> None:
        stream = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), pipe
        )
        try:
            while True:
                try:
                    line = await stream.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    line = await stream.read(65536)
                if not line:
                    return
                if not line.endswith(b"\n"):
                    line += b"\n"
                self._out.write(self.prefix + line)
                self._out.flush()
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
        finally:
            transport.close()

    async def _read_reports(self, fd: int) -> None:
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
        )
        try:
            while line := await reader.readline():
                report = reports.decode(line)
                if report is not None:
                    self._on_report(report)
        finally:
            transport.close()

    async def _wait(self) -> None:
        self.exit_code = await _exit_code(self.popen)
        self.exited.set()
        self.close_control()
        self._on_exit()
        # Let the output pumps drain before closing the log file.
        await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._log is not None:
            self._log.close()
            self._log = None


async def stop(procs: list[Proc], grace: float) -> None:
    """Stop ``procs``: SIGTERM, then SIGKILL after ``grace`` seconds (0: SIGKILL now); return once
    every one has exited. Their children in their process groups die with them."""
    live = [p for p in procs if p.exit_code is None]
    for p in live:
        p.signal(signal.SIGKILL if grace <= 0 else signal.SIGTERM)
    if grace > 0 and live:
        await asyncio.wait([asyncio.ensure_future(p.exited.wait()) for p in live], timeout=grace)
        for p in live:
            if not p.exited.is_set():
                p.signal(signal.SIGKILL)
    await asyncio.gather(*(p.exited.wait() for p in live), return_exceptions=True)
    for p in live:
        p.signal(signal.SIGKILL)  # grandchildren left in the group


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
