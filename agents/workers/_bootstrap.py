"""Entry point of every worker process an agent starts (``python -m ftrt.agents.workers._bootstrap``).

A worker starts *warm*: it imports torch (the slow part of a Python worker's start, 1.5-3 s here),
optionally opens the TCPStore its round will use, reports ``ready`` and blocks until the agent
sends its assignment: the torchrun environment, argv and the script or module. It then becomes
that script (``runpy``, ``__name__ == "__main__"``), so a restart costs a rendezvous, not an
interpreter boot. A cold start is the same path with the assignment sent at once.

Wire protocol (JSON lines):

- agent -> worker on ``FTRT_CONTROL_FD``: one ``{"env": {...}, "argv": [...], "script": str|null,
  "module": str|null, "cwd": str}``; then, to a worker that changes rounds in place, its next
  rounds (:mod:`ftrt.control`, read through :class:`ftrt.Runtime`);
- worker -> agent on ``FTRT_REPORT_FD``: :class:`ftrt.reports.Ready` once warm, then whatever the
  script reports through :class:`ftrt.Runtime` (:mod:`ftrt.reports` owns every message type).

The process dies with its agent (``PR_SET_PDEATHSIG``) and runs the fence watchdog
(:mod:`ftrt.agents.workers.fence`) once assigned. Started as a *template* (:mod:`ftrt.agents.workers.template`),
it does the warm imports once and then forks spares, each of which goes on from here as a spare
started directly would.
"""

import gc
import json
import os
import sys

from ftrt import envnames, reports
from ftrt.agents.workers import template

_STORE = None  # the round's TCPStore server lives as long as this process


def _set_idle(idle: bool) -> None:
    """Warm up at SCHED_IDLE when asked (a spare must not slow the running workers)."""
    try:
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except (AttributeError, OSError, PermissionError):
        pass


def _report(fd: int, message: reports.Report) -> None:
    os.write(fd, reports.encode(message))


def _freeze_heap() -> None:
    """Move every object alive (the warm imports', ~320k with torch) out of the garbage
    collector's reach for good (``gc.freeze``). Otherwise the first full collection in each
    worker walks them all: ~0.2 s here, at a random point early in the worker's life, and every
    other rank waits for it in the next collective (measured at rounds' restores with
    ``FTRT_DIAG_TRACE``). Forked spares inherit the frozen heap, and no collection then writes to
    its shared pages. No collection first: the imports leave a few dozen cyclic objects, not worth
    ~0.1 s on a cold start's path."""
    gc.freeze()


def _read_assignment(fd: int) -> dict:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            os._exit(0)  # the agent closed the pipe: this spare is not needed any more
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return json.loads(b"".join(chunks))


def main() -> None:
    global _STORE
    template.die_with(int(os.environ.get(envnames.AGENT_PID, os.getppid())))
    report_fd = int(os.environ[envnames.REPORT_FD])
    idle = os.environ.pop(envnames.WARM_IDLE, "0") == "1"
    _set_idle(idle)
    for name in filter(None, os.environ.pop(envnames.WARM_IMPORTS, "").split(",")):
        try:
            __import__(name)
        except ImportError as exc:
            sys.stderr.write(f"ftrt: warm import of {name!r} failed: {exc}\n")
    _freeze_heap()
    if idle:
        _set_idle(False)  # before the store's thread exists, so it serves at normal priority
    template_fd = os.environ.pop(template.ENV, None)
    if template_fd is not None:
        spare = template.serve(int(template_fd), report_fd)  # returns in each forked spare
        control_fd, report_fd, hosts_store = spare.control_fd, spare.report_fd, spare.hosts_store
    else:
        control_fd = int(os.environ.pop(envnames.CONTROL_FD))
        hosts_store = os.environ.pop(envnames.WARM_STORE, "0") == "1"
    store_port = 0
    if hosts_store:
        import torch.distributed as dist

        # The server listens on every interface; the name is only for its own client connection.
        _STORE = dist.TCPStore(
            "127.0.0.1", 0, is_master=True,
            wait_for_workers=False, use_libuv=True,
        )
        store_port = _STORE.port
    _report(report_fd, reports.Ready(os.getpid(), store_port))

    job = _read_assignment(control_fd)
    os.environ.update(job["env"])
    # The pipe stays open: a worker that changes rounds in place reads its next rounds there
    # (ftrt.control). Its children do not inherit it.
    os.set_inheritable(control_fd, False)
    os.environ[envnames.CONTROL_FD] = str(control_fd)
    os.chdir(job["cwd"])
    fence_path = os.environ.get(envnames.FENCE_FILE)
    from ftrt import _diag

    _diag.trace_gc()
    _diag.mark("assigned")

    if fence_path and not _diag.off("fence"):
        from ftrt.agents.workers.fence import start_watchdog

        start_watchdog(fence_path)

    try:
        _run(job)
    except BaseException as exc:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            from ftrt.agents.workers import unfixable

            if (why := unfixable.explain(exc)) is not None:
                unfixable.write_note(error_file, why)  # the agent fails the job instead of restarting it
        raise


def _run(job: dict) -> None:
    """Become the assigned script or module, as ``python SCRIPT`` or ``python -m MODULE`` would."""
    import runpy

    if job.get("script"):
        script = job["script"]
        sys.argv = [script, *job["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = [job["module"], *job["argv"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
