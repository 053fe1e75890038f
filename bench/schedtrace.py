"""Who takes the CPU from the training processes: a ``sched_switch`` capture from the kernel's tracefs.

The step-time ratio of ``python -m bench overhead`` moves by several percent between runs on a
shared VM, more than the effect it looks for. This measures the mechanism instead, from the
kernel's own record of every context switch during a few seconds of steady training:

- how long the workers' main threads were runnable but off the CPU (preempted), per second;
- how often they were preempted, and by which group of tasks (etcd, the node agents, the
  workers' own helper threads, spare workers, anything else on the machine);
- how much CPU each group used meanwhile.

It needs root and tracefs (``/sys/kernel/tracing``, mounted here if it is not); without them
:func:`unavailable` says why and the bench runs without it. Parsing and attribution are pure
functions over the trace text, so they are tested without a kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TRACEFS = Path("/sys/kernel/tracing")
_SWITCH = re.compile(
    r"\[(?P<cpu>\d+)\]\s.*?\s(?P<t>\d+\.\d+): sched_switch: prev_comm=(?P<pc>.*?) prev_pid=(?P<pp>\d+) "
    r"prev_prio=\d+ prev_state=(?P<st>\S+) ==> next_comm=(?P<nc>.*?) next_pid=(?P<np>\d+) next_prio=\d+"
)
WORKER = "worker"
"""The group of the workers' main threads (the ones whose preemptions are counted)."""


@dataclass(frozen=True)
class Switch:
    """One ``sched_switch`` event: ``prev`` leaves CPU ``cpu`` at ``t``, ``next`` runs."""

    cpu: int
    t: float
    prev_tid: int
    prev_runnable: bool
    next_tid: int


def parse(text: str) -> list[Switch]:
    """The ``sched_switch`` events of a tracefs ``trace`` file, in order; other lines are skipped."""
    out = []
    for line in text.splitlines():
        m = _SWITCH.search(line)
        if m:
            # prev_state "R" or "R+" means it was still runnable: preempted, not blocked.
            out.append(Switch(int(m["cpu"]), float(m["t"]), int(m["pp"]), m["st"].startswith("R"), int(m["np"])))
    return out


def attribute(switches: list[Switch], groups: dict[int, str]) -> dict:
    """Per second of trace: the workers' preempted time and preemptions, and each group's share.

    ``groups`` maps thread ids to a group name; the :data:`WORKER` group's threads are the ones
    whose preemptions are counted. Threads not in ``groups`` are ``other``; tid 0 is the idle task.
    """
    if len(switches) < 2:
        raise ValueError("the trace holds fewer than two context switches; was the tracer on?")
    span = switches[-1].t - switches[0].t
    preempted_at: dict[int, float] = {}
    preempted_s = 0.0
    preemptions: dict[str, int] = defaultdict(int)
    cpu_s: dict[str, float] = defaultdict(float)
    running: dict[int, tuple[int, float]] = {}  # cpu -> (tid, since)
    for sw in switches:
        if sw.cpu in running:
            tid, since = running[sw.cpu]
            if tid != 0:
                cpu_s[groups.get(tid, "other")] += sw.t - since
        running[sw.cpu] = (sw.next_tid, sw.t)
        if groups.get(sw.prev_tid) == WORKER and sw.prev_runnable:
            preemptions[groups.get(sw.next_tid, "other") if sw.next_tid else "idle"] += 1
            preempted_at[sw.prev_tid] = sw.t
        if sw.next_tid in preempted_at:
            preempted_s += sw.t - preempted_at.pop(sw.next_tid)
    return {
        "seconds": round(span, 2),
        "worker_preempted_ms_per_s": round(preempted_s / span * 1000, 2),
        "preemptions_per_s": round(sum(preemptions.values()) / span, 1),
        "preemptions_per_s_by": {g: round(n / span, 1) for g, n in sorted(preemptions.items(), key=lambda x: -x[1])},
        "cpu_ms_per_s_by": {g: round(s / span * 1000, 2) for g, s in sorted(cpu_s.items(), key=lambda x: -x[1])},
    }


def unavailable() -> str | None:
    """Why a capture cannot run here, or ``None`` when it can (mounting tracefs if needed)."""
    if os.geteuid() != 0:
        return "tracing scheduler events needs root"
    if not (TRACEFS / "events" / "sched" / "sched_switch").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], capture_output=True)
        if not (TRACEFS / "events" / "sched" / "sched_switch").exists():
            return f"no tracefs with sched_switch events at {TRACEFS}"
    return None


def capture(seconds: float, buffer_kb: int = 60_000) -> str:
    """Record every context switch for ``seconds``; return the trace text (tracing off afterwards)."""
    def put(name: str, value: str) -> None:
        (TRACEFS / name).write_text(value)

    put("tracing_on", "0")
    put("buffer_size_kb", str(buffer_kb))
    put("trace", "")
    put("events/sched/sched_switch/enable", "1")
    try:
        put("tracing_on", "1")
        time.sleep(seconds)
    finally:
        put("tracing_on", "0")
        put("events/sched/sched_switch/enable", "0")
    text = (TRACEFS / "trace").read_text()
    put("trace", "")
    return text


def threads(pid: int) -> list[int]:
    """Thread ids of a process (empty once it has gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def cpu_ticks(pid: int) -> int:
    """User plus system CPU of a process so far, in clock ticks (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def steal_seconds() -> float:
    """CPU time the hypervisor has taken from this VM's vCPUs since boot (``steal`` in
    ``/proc/stat``, summed over CPUs; 0.0 where the kernel does not report it). A run whose steal
    grew was slowed by the host, not by what it measures."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0
