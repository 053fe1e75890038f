"""Spares forked from a warm template: a replacement spare costs a fork, not a Python start.

A spare's warm-up (importing torch, DDP, dynamo, DCP, ftrt's checkpointer) takes ~5 CPU-seconds
and ~800 MB here, and every round used to cost each node one: the round's workers are spares,
and the node replaces them. On a node whose cores all train, that CPU is taken from training.
The pool instead keeps one *template*: a bootstrap process that did the warm imports once and
then only forks. A fork of it is a warm spare in ~15 ms, sharing the template's pages until it
writes them.

Both ends live here, so the wire contract has one owner:

- the agent starts the template as a bootstrap with :data:`ENV` set to its end of a Unix
  ``SOCK_SEQPACKET`` pair, and asks for a spare with :func:`fork_spare`: one message
  ``{"hosts_store": bool}`` carrying four descriptors (the spare's control read end, report
  write end, stdout and stderr write ends); the template replies ``{"pid": N}``;
- the template (:func:`serve`, in the bootstrap process) forks, and reports each child's exit on
  its own report pipe as :class:`ftrt.reports.SpareExit` (the agent is not the parent, so
  it cannot wait for the child itself; ``C`` is a Popen-style return code);
- in the child, :func:`serve` returns the spare's descriptors, and the bootstrap goes on as a
  spare started directly would.

A child is in its own process group (the pool stops a worker by signalling its group) and dies
with the template (``PR_SET_PDEATHSIG``), which dies with the agent. The template refuses to
fork once CUDA is initialised in it (a forked child could not use the GPU): it exits, and the
pool starts spares directly from then on.

The agent's handle on its template, :class:`SpareTemplate`, lives here too. This module and what it
imports are light (the standard library, :mod:`ftrt.reports`): the template's imports are the warm
imports.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass

from ftrt import envnames, reports
from ftrt.procs import die_with
from ftrt.agents.workers.procs import ForkedProc, Proc, Spawned, spawn_bootstrap

ENV = envnames.TEMPLATE_FD
"""Set (to the template's socket descriptor) in a bootstrap that is to be a template."""

REPLY_TIMEOUT_S = 5.0
"""The longest the agent waits for the template's reply to a fork request (a fork takes ~15 ms)."""


class TemplateError(OSError):
    """The template did not fork a spare (it died, or did not answer in time)."""


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """The agent's and the template's ends of a new request channel."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def fork_spare(sock: socket.socket, *, hosts_store: bool) -> tuple[ForkedProc, int, int]:
    """Ask the template for a spare (blocking: ~15 ms). Returns the spare, the agent's control
    write end and report read end. Raises :class:`TemplateError` if the template does not answer."""
    ctl_r, ctl_w = os.pipe()
    rep_r, rep_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    theirs = [ctl_r, rep_w, out_w, err_w]
    ours = [ctl_w, rep_r, out_r, err_r]
    try:
        sock.settimeout(REPLY_TIMEOUT_S)
        socket.send_fds(sock, [json.dumps({"hosts_store": hosts_store}).encode()], theirs)
        reply = sock.recv(4096)
        if not reply:
            raise TemplateError("the spare template closed its socket (it exited)")
        pid = int(json.loads(reply)["pid"])
    except (OSError, ValueError, KeyError) as exc:
        for fd in ours:
            os.close(fd)
        if isinstance(exc, TemplateError):
            raise
        raise TemplateError(f"the spare template did not fork a spare: {exc}") from exc
    finally:
        for fd in theirs:
            os.close(fd)
    proc = ForkedProc(pid, os.fdopen(out_r, "rb", 0), os.fdopen(err_r, "rb", 0))
    return proc, ctl_w, rep_r


@dataclass(frozen=True)
class SpareFds:
    """What a forked child needs to go on as a spare."""

    control_fd: int
    report_fd: int
    hosts_store: bool


def _report(fd: int, message: reports.Report) -> None:
    os.write(fd, reports.encode(message))


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported torch: do not fork from it
        return True


def serve(sock_fd: int, report_fd: int) -> SpareFds:
    """The template's loop, once its warm imports are done: report ready, then fork a spare per
    request and report each child's exit. Returns only in a forked child, set up as a spare (own
    process group, dies with the template, stdio on the agent's pipes, ``FTRT_REPORT_FD`` its
    own). Exits when the agent closes the socket."""
    if _cuda_initialized():
        sys.stderr.write("ftrt: a warm import initialised CUDA, so spares cannot be forked from a template "
                         "(a forked child cannot use the GPU); spares start directly instead.\n")
        os._exit(3)
    _report(report_fd, reports.Ready(os.getpid(), 0))
    sock = socket.socket(fileno=sock_fd)
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for ready in readable:
            if ready is sock:
                msg, fds, _, _ = socket.recv_fds(sock, 4096, 4)
                if not msg:
                    os._exit(0)  # the agent is gone, or closed the pool
                request = json.loads(msg)
                template_pid = os.getpid()
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    for pidfd in children:
                        os.close(pidfd)
                    os.close(report_fd)
                    return _become_spare(fds, bool(request.get("hosts_store")), template_pid)
                try:
                    os.setpgid(pid, pid)  # also done by the child: whichever runs first
                except OSError:
                    pass
                for fd in fds:
                    os.close(fd)
                children[os.pidfd_open(pid)] = pid
                sock.send(json.dumps({"pid": pid}).encode())
            else:
                pid = children.pop(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                _report(report_fd, reports.SpareExit(pid, os.waitstatus_to_exitcode(status)))


def _become_spare(fds: list[int], hosts_store: bool, template_pid: int) -> SpareFds:
    control_fd, report_fd, out_fd, err_fd = fds
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    die_with(template_pid)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (null, out_fd, err_fd):
        os.close(fd)
    os.environ[envnames.REPORT_FD] = str(report_fd)
    return SpareFds(control_fd, report_fd, hosts_store)


# -- the agent's side ---------------------------------------------------------------------------
def spawn_template(*, base_env: dict[str, str], fence_path: str, warm_imports: tuple[str, ...],
                   idle: bool) -> tuple[Spawned, socket.socket]:
    """Start a spare template: the process and the agent's end of its request socket (synchronous,
    like :func:`~ftrt.agents.workers.procs.spawn_bootstrap`)."""
    ours, theirs = socket_pair()
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


class SpareTemplate:
    """The agent's handle on its template process and request socket. ``proc`` is the template as
    the agent watches it; its reports go to :meth:`on_report` (the pool wires that up)."""

    def __init__(self, proc: Proc, sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.ready = asyncio.Event()
        """Set once the template finished its warm imports (or died)."""
        self.forked: dict[int, ForkedProc] = {}
        """Spares forked and not yet reported exited, by pid."""

    @property
    def usable(self) -> bool:
        return self.ready.is_set() and self.proc.exit_code is None

    @property
    def warming(self) -> bool:
        return not self.ready.is_set() and self.proc.exit_code is None

    def on_report(self, report: reports.Report) -> None:
        """The template's reports: ready once warm, then the exit of each spare it forked."""
        match report:
            case reports.Ready():
                self.ready.set()
            case reports.SpareExit(pid=pid, code=code):
                proc = self.forked.pop(pid, None)
                if proc is not None:
                    proc.finished(code)

    def fork(self, hosts_store: bool) -> Spawned:
        """A warm spare, forked now (raises :class:`TemplateError`)."""
        proc, control_fd, report_fd = fork_spare(self.sock, hosts_store=hosts_store)
        self.forked[proc.pid] = proc
        return Spawned(proc, control_fd, report_fd, hosts_store, time.monotonic())

    def lost(self) -> None:
        """The template exited: its children die with it (``PR_SET_PDEATHSIG``); make sure of it
        and tell their waiters."""
        self.ready.set()  # nobody waits forever on a dead template
        self.sock.close()
        for pid, proc in list(self.forked.items()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.finished(-signal.SIGKILL)
        self.forked.clear()


__all__ = ["ENV", "SpareFds", "SpareTemplate", "TemplateError", "die_with", "fork_spare", "serve", "socket_pair",
           "spawn_template"]
