"""Steady-state overhead: the same GRPO job without faults under torchrun and under ``ftrt launch``.

Both run the built-in GRPO trainer (the goodput bench's job) on 2 simulated nodes of 1 worker,
with a checkpoint to local disk every ``--ckpt-every`` steps. Under ``ftrt launch`` the job also
has everything ftrt adds in steady state: agents with etcd leases and heartbeats, warm spare
workers, and a checkpoint in memory (replicated to the peer node) after every step. torchrun runs
c10d at the settings ``python -m bench recovery`` gives it.

Step time is the wall time per step once warm: (end of the last step - end of the first step
measured) / steps in between, so whatever happens between steps (checkpoint saves, heartbeats)
counts. Measuring starts after ``--warmup`` steps and, under ftrt, once the agents' spare workers
are warm (starting them is a one-off ~10 s of CPU per job and per membership change).
Runs alternate between the systems (the order flips each repeat), so drift in the machine's
speed falls on both; the ratio is ftrt's step time over torchrun's, per pair and overall.
``--breakdown`` runs ftrt variants that each switch one steady-state component off (see
:data:`VARIANTS`): its cost is the step time of the variant it is taken from over the variant
without it, per interleaved repeat. Every run also records the CPU the node agents and etcd took
per second of steady training (from /proc). ``--pin`` puts the workers on core 1 and everything
else (agents, etcd, this bench) on core 0 for both systems: on this 2-core machine that separates
the control plane's cost from its competing with the workers for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import schedtrace
from bench.goodput import add_job_options, job_config, save_result
from bench.recovery import Cluster
from ftrt import progress
from ftrt.chaos.local import read_jsonl, spares_warm

TARGET = 1.02
"""ftrt's step time over torchrun's that issues 6 and 14 ask for at most."""
WARM_CHECK_EVERY_S = 1.0
"""How often the agents are asked (``Status``) whether their spares are warm, until they are: the
answers cost the agents CPU, which this bench measures."""


@dataclass(frozen=True)
class Variant:
    """One way to run the job under ftrt: GRPO overrides, launch options, ``FTRT_DIAG_OFF``."""

    grpo: dict = field(default_factory=dict)
    launch: tuple[str, ...] = ()
    off: str = ""
    base: str | None = None
    """The variant this one takes a component away from (its cost is base's time over this one's)."""
    component: str = ""
    etcd: str = "open"
    """How the cluster's etcd admits clients (:data:`bench.recovery.ETCD_MODES`)."""


MEM1 = {"checkpoint.memory_interval": 1}
VARIANTS: dict[str, Variant] = {
    "ftrt": Variant(),
    "ftrt-closed": Variant(etcd="closed"),
    "ftrt-nohb": Variant(off="heartbeat", base="ftrt", component="heartbeats"),
    "ftrt-nofence": Variant(off="fence", base="ftrt", component="fence watchdog"),
    "ftrt-nowarm": Variant(launch=("--no-warm",), base="ftrt", component="spare workers"),
    "ftrt-mem1": Variant(grpo=MEM1),
    "ftrt-mem1-novote": Variant(grpo=MEM1, off="vote", base="ftrt-mem1", component="skip vote (collective)"),
    "ftrt-mem1-norepl": Variant(grpo=MEM1, launch=("--replica-interval", "1e9"), base="ftrt-mem1",
                                component="replication to the peer"),
    "ftrt-nomem": Variant(grpo={"checkpoint.memory_interval": 0}, base="ftrt-mem1",
                          component="memory checkpoint every step (staging + vote + replication)"),
    "ftrt-bare": Variant(grpo={"checkpoint.memory_interval": 0}, launch=("--no-warm",), off="heartbeat,fence",
                         base="ftrt", component="all of the above at once (no heartbeats, watchdog, spares "
                                                "or memory checkpoints: the agents, etcd and the launch remain)"),
}
"""ftrt's variants: ``ftrt`` is the default (``auto`` checkpoint cadence); ``ftrt-mem1`` the old
default, a memory checkpoint after every step."""
SYSTEMS = ("torchrun", *VARIANTS)
BREAKDOWN = ("torchrun", "ftrt", "ftrt-nohb", "ftrt-nofence", "ftrt-nowarm", "ftrt-mem1", "ftrt-mem1-novote",
             "ftrt-mem1-norepl", "ftrt-nomem", "ftrt-bare")


def run_one(system: str, *, steps: int, warmup: int, ckpt_every: int, grpo: dict, trace_s: float = 0.0,
            pin: bool = False) -> dict:
    """Train ``steps`` steps on a fresh 2-node cluster; return the steady step time.

    The steady window starts after ``warmup`` steps and, under ftrt, once every agent's spare
    workers are warm: starting them (importing torch, ~10 s of CPU here) happens once per job and
    per membership change, not per step. With ``trace_s``, the context switches of ``trace_s``
    seconds of that window are recorded and attributed (:func:`sched_breakdown`).
    """
    work = Path(tempfile.mkdtemp(prefix=f"bench-overhead-{system}-"))
    metrics = work / "metrics.jsonl"
    variant = VARIANTS.get(system, Variant())
    overrides = {**grpo, "steps": steps, "metrics_path": str(metrics), "checkpoint.url": str(work / "ckpt"),
                 "checkpoint.interval": ckpt_every, **variant.grpo}
    c = Cluster("torchrun" if system == "torchrun" else "ftrt", work, nnodes="2", launch_extra=variant.launch,
                env_extra={"FTRT_DIAG_OFF": variant.off} if variant.off else None, etcd=variant.etcd)
    warm_at = None
    next_warm_check = 0.0
    never_warm = "--no-warm" in c.launch_extra  # no spares to ask about
    sched = None
    pinned: set[int] = set()
    cpu: list[tuple[float, int, int]] = []  # (time, agents' ticks, etcd's ticks)
    try:
        t0 = time.time()
        for name in ("n0", "n1"):
            c.add(name, ["-m", "ftrt.grpo", *(f"{k}={v}" for k, v in overrides.items())])
        deadline = time.monotonic() + 60 + steps * 5
        while any(n.alive() for n in c.nodes.values()):
            if warm_at is None and not never_warm and time.monotonic() >= next_warm_check:
                next_warm_check = time.monotonic() + WARM_CHECK_EVERY_S
                if c.system == "torchrun" or spares_warm(c.nodes.values()):
                    warm_at = time.time()
            if trace_s and sched is None and warm_at is not None and _logged(metrics) > warmup:
                sched = sched_breakdown(c, trace_s)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: the job did not end within {deadline:.0f} s; its logs are in {work}")
            if pin:
                pin_cluster(c, pinned)
            cpu.append((time.time(), sum(schedtrace.cpu_ticks(n.pid) for n in c.nodes.values()),
                        schedtrace.cpu_ticks(c.etcd_pid) if c.etcd_pid is not None else 0))
            time.sleep(0.1)
        codes = {name: n.proc.returncode for name, n in c.nodes.items()}
        wall = time.time() - t0
        lines = read_jsonl(metrics)
    finally:
        c.close()
    if codes != {"n0": 0, "n1": 0} or [x["step"] for x in lines] != list(range(steps)):
        raise RuntimeError(f"{system}: the job did not train steps 0..{steps - 1} cleanly "
                           f"(exit codes {codes}, {len(lines)} steps logged); its logs are in {work}")
    shutil.rmtree(work, ignore_errors=True)
    # Spares warm at idle priority (for longer when faults are rare): if they were not warm before
    # the job ended, their idle warm-up is part of the window, and the row says so.
    start = max(warmup, next((i for i, x in enumerate(lines) if warm_at is not None and x["time"] >= warm_at),
                             warmup if warm_at is None else steps))
    steady = lines[start:]
    if len(steady) < 20:
        raise RuntimeError(f"{system}: only {len(steady)} steps ran after warm-up (spares warm at step {start}); "
                           f"give more --steps")
    per_step = (steady[-1]["time"] - steady[0]["time"]) / (len(steady) - 1)
    out = {"system": system, "step_s": round(per_step, 5),
           "median_compute_s": round(statistics.median(x["step_s"] for x in steady), 5),
           "longest_step_gap_s": round(max(b["time"] - a["time"] for a, b in zip(steady, steady[1:])), 3),
           "steps": steps, "measured_from": start, "wall_s": round(wall, 1), "spares_warm": warm_at is not None,
           "control_cpu_ms_per_s": control_cpu(cpu, steady[0]["time"], steady[-1]["time"]), "pinned": pin}
    if trace_s:
        if sched is None:
            raise RuntimeError(f"{system}: the job ended before its scheduler trace was taken; give more --steps")
        out["sched"] = sched
    return out


def control_cpu(samples: list[tuple[float, int, int]], t0: float, t1: float) -> dict:
    """CPU milliseconds per second the node agents and etcd took between ``t0`` and ``t1``."""
    inside = [x for x in samples if t0 <= x[0] <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return {}
    (a0, g0, e0), (a1, g1, e1) = inside[0], inside[-1]
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    return {"agents": round((g1 - g0) * tick_ms / (a1 - a0), 1), "etcd": round((e1 - e0) * tick_ms / (a1 - a0), 1)}


def pin_cluster(c: Cluster, done: set[int]) -> None:
    """Workers (and spares) on core 1; agents and etcd on core 0. Each thread once (threads a
    pinned thread creates inherit its affinity)."""
    def put(pid: int, core: int) -> None:
        for tid in schedtrace.threads(pid):
            if tid not in done:
                try:
                    os.sched_setaffinity(tid, {core})
                    done.add(tid)
                except OSError:
                    pass  # gone already

    for n in c.nodes.values():
        tree = n.tree()
        put(tree[0], 0)
        for pid in tree[1:]:
            put(pid, 1)
    if c.etcd_pid is not None:
        put(c.etcd_pid, 0)


def _logged(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def sched_breakdown(c: Cluster, seconds: float) -> dict:
    """Record ``seconds`` of context switches now and attribute them (:mod:`bench.schedtrace`).

    Groups: the workers' main threads (whose preemptions count), their other threads, the node
    agents (ftrt's or torchrun's), spare workers, etcd, and everything else on the machine. The
    workers are, per node, the descendant that used the most CPU during the capture.
    """
    roots = [n.pid for n in c.nodes.values()]
    below = {r: n.tree()[1:] for r, n in zip(roots, c.nodes.values())}
    before = {p: schedtrace.cpu_ticks(p) for ps in below.values() for p in ps}
    groups: dict[int, str] = {}
    for pid in (p for ps in below.values() for p in ps):
        groups.update(dict.fromkeys(schedtrace.threads(pid), "spares"))
    for root in roots:
        groups.update(dict.fromkeys(schedtrace.threads(root), "agents"))
    if c.etcd_pid is not None:
        groups.update(dict.fromkeys(schedtrace.threads(c.etcd_pid), "etcd"))
    text = schedtrace.capture(seconds)
    for root, ps in below.items():
        if ps:
            worker = max(ps, key=lambda p: schedtrace.cpu_ticks(p) - before[p])
            groups.update(dict.fromkeys(schedtrace.threads(worker), "worker threads"))
            groups[worker] = schedtrace.WORKER
    return schedtrace.attribute(schedtrace.parse(text), groups)


def run(systems: list[str], reps: int, steps: int, warmup: int, ckpt_every: int, grpo: dict,
        trace_s: float = 0.0, pin: bool = False) -> dict:
    rows = []
    with progress.bar(reps * len(systems), "overhead", "run") as shown:
        for rep in range(reps):
            order = systems if rep % 2 == 0 else systems[::-1]
            for system in order:
                r = run_one(system, steps=steps, warmup=warmup, ckpt_every=ckpt_every, grpo=grpo, trace_s=trace_s,
                            pin=pin)
                r["rep"] = rep
                rows.append(r)
                print(json.dumps(r), flush=True)
                shown.update()
    return {"rows": rows, "summary": summarize(rows, systems)}


def median_interval(values: list[float], level: float = 0.9, resamples: int = 10_000,
                    seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the median of ``values`` (percentile method, fixed seed).

    This machine's speed drifts by several percent over minutes, so one pair of runs says little;
    the interval says how far the median pair ratio could move with other runs like these.
    """
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return meds[int((1 - level) / 2 * resamples)], meds[int((1 + level) / 2 * resamples) - 1]


def verdict(lo: float, hi: float) -> str:
    """What the pair ratios' interval says about the target."""
    if hi <= TARGET:
        return f"met (the whole interval is <= {TARGET})"
    if lo > TARGET:
        return f"not met (the whole interval is above {TARGET})"
    return f"not settled by these runs (the interval straddles {TARGET})"


def summarize(rows: list[dict], systems: list[str]) -> dict:
    def times(system: str) -> list[float]:
        return [r["step_s"] for r in sorted(rows, key=lambda r: r["rep"]) if r["system"] == system]

    base = times("torchrun")
    out: dict = {"torchrun": {"median_step_s": statistics.median(base), "runs": base}}
    for system in systems:
        if system == "torchrun":
            continue
        mine = times(system)
        pairs = [round(a / b, 4) for a, b in zip(mine, base)]
        out[system] = {"median_step_s": statistics.median(mine), "runs": mine, "pair_ratios": pairs,
                       "ratio": round(statistics.median(mine) / statistics.median(base), 4),
                       "median_pair_ratio": round(statistics.median(pairs), 4),
                       "median_pair_ratio_90": [round(v, 4) for v in median_interval(pairs)]}
    for system in systems:
        traced = [r["sched"] for r in rows if r["system"] == system and "sched" in r]
        if traced:
            out[system]["sched"] = mean_sched(traced)
        cpus = [r["control_cpu_ms_per_s"] for r in rows if r["system"] == system and r.get("control_cpu_ms_per_s")]
        if cpus:
            out[system]["control_cpu_ms_per_s"] = {k: round(statistics.mean(c[k] for c in cpus), 1) for k in cpus[0]}
    breakdown = components(rows, systems)
    if breakdown:
        out["_components"] = breakdown
    return out


def components(rows: list[dict], systems: list[str]) -> dict:
    """Each switched-off component's cost: its base variant's step time over the variant's without
    it, per repeat (both ran in the same repeat), with the median and its 90 % interval."""
    def by_rep(system: str) -> dict[int, float]:
        return {r["rep"]: r["step_s"] for r in rows if r["system"] == system}

    out = {}
    for name in systems:
        v = VARIANTS.get(name)
        if v is None or v.base is None or v.base not in systems:
            continue
        base, mine = by_rep(v.base), by_rep(name)
        pairs = [round(base[k] / mine[k], 4) for k in sorted(base) if k in mine]
        if pairs:
            out[name] = {"component": v.component, "base": v.base, "pair_ratios": pairs,
                         "median": round(statistics.median(pairs), 4),
                         "median_90": [round(x, 4) for x in median_interval(pairs)]}
    return out


def mean_sched(traces: list[dict]) -> dict:
    """The mean over runs of each scheduler-trace number (a group missing from a run counts 0)."""
    def mean_by(key: str) -> dict:
        names = dict.fromkeys(g for t in traces for g in t[key])
        return {g: round(statistics.mean(t[key].get(g, 0.0) for t in traces), 2) for g in names}

    return {"runs": len(traces),
            "worker_preempted_ms_per_s": round(statistics.mean(t["worker_preempted_ms_per_s"] for t in traces), 2),
            "preemptions_per_s": round(statistics.mean(t["preemptions_per_s"] for t in traces), 1),
            "preemptions_per_s_by": mean_by("preemptions_per_s_by"), "cpu_ms_per_s_by": mean_by("cpu_ms_per_s_by")}


def render(summary: dict) -> str:
    base = summary["torchrun"]["median_step_s"]
    parts = summary.get("_components", {})
    systems = {k: v for k, v in summary.items() if not k.startswith("_")}
    w = max(12, *(len(k) + 2 for k in systems))
    lines = [f"{'system':<{w}}{'step time (median)':>20}  {'runs':<40}{'ratio':>7}  {'agents+etcd CPU':>16}  pairs"]
    for system, s in systems.items():
        runs = " ".join(f"{v * 1000:.1f}" for v in s["runs"])
        ratio = f"{s['median_step_s'] / base:.3f}" if system != "torchrun" else "1"
        pairs = " ".join(f"{v:.3f}" for v in s.get("pair_ratios", []))
        cpu = s.get("control_cpu_ms_per_s", {})
        cpu_text = f"{cpu.get('agents', 0) + cpu.get('etcd', 0):.1f} ms/s" if cpu else "-"
        lines.append(f"{system:<{w}}{s['median_step_s'] * 1000:>17.1f} ms  {runs:<40}{ratio:>7}  {cpu_text:>16}  {pairs}")
    if parts:
        lines.append("")
        lines.append("Components (cost = step time with it over step time without it, same repeat):")
        for name, c in parts.items():
            lo, hi = c["median_90"]
            lines.append(f"  {c['component']:<62} {c['median']:.3f} (90 % {lo:.3f}-{hi:.3f}; {c['base']} vs {name}; "
                         f"pairs {' '.join(f'{v:.3f}' for v in c['pair_ratios'])})")
    for system, s in systems.items():
        if "pair_ratios" in s:
            lo, hi = s["median_pair_ratio_90"]
            lines.append(f"{system}: median of the {len(s['pair_ratios'])} pair ratios {s['median_pair_ratio']:.3f} "
                         f"(90 % bootstrap interval {lo:.3f}-{hi:.3f}), mean {statistics.mean(s['pair_ratios']):.3f}; "
                         f"target {verdict(lo, hi)}")
    lines.append("(runs in ms per step; ratio: median step time over torchrun's; pairs: each repeat's ratio; "
                 f"target for ftrt: <= {TARGET})")
    traced = {system: s["sched"] for system, s in systems.items() if "sched" in s}
    if traced:
        lines.append("")
        lines.append("Scheduler trace of the workers' main threads (mean over runs; per second of training, both workers):")
        for system, t in traced.items():
            by = ", ".join(f"{g} {n:.0f}" for g, n in t["preemptions_per_s_by"].items())
            cpu = ", ".join(f"{g} {ms:.1f}" for g, ms in t["cpu_ms_per_s_by"].items() if g != schedtrace.WORKER)
            lines.append(f"{system:<12}preempted {t['worker_preempted_ms_per_s']:.1f} ms/s; "
                         f"{t['preemptions_per_s']:.0f} preemptions/s (by {by})")
            lines.append(f"{'':<12}CPU ms/s of the others: {cpu}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="runs per system, interleaved (default 3)")
    p.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="first steps left out of the step time (default 20)")
    p.add_argument("--systems", default="torchrun,ftrt", help=f"comma-separated, from {list(SYSTEMS)}; "
                   "torchrun is always run (it is the baseline)")
    p.add_argument("--sched-trace", type=float, default=0.0, metavar="SECONDS",
                   help="record this many seconds of each run's context switches (root and tracefs) and "
                        "report who preempts the workers (default 0: off)")
    p.add_argument("--breakdown", action="store_true",
                   help=f"run every variant that switches one component off ({', '.join(BREAKDOWN[1:])}) "
                        "and report each component's cost")
    p.add_argument("--pin", action="store_true",
                   help="workers on core 1, agents and etcd (and this bench) on core 0, for both systems")
    p.add_argument("--summarize", metavar="JSON", default=None,
                   help="print the table of an earlier result file instead of running")
    add_job_options(p, "overhead")
    args = p.parse_args(argv)
    if args.summarize:
        try:
            rows = json.loads(Path(args.summarize).read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--summarize {args.summarize}: not an overhead result file ({exc})")
        names = list(dict.fromkeys(r["system"] for r in rows))
        print(render(summarize(rows, names)))
        return 0
    systems = list(BREAKDOWN) if args.breakdown else list(dict.fromkeys(["torchrun", *(s for s in args.systems.split(",") if s)]))
    if unknown := sorted(set(systems) - set(SYSTEMS)):
        p.error(f"--systems names {unknown}; choose from {list(SYSTEMS)}")
    if not 1 <= args.warmup < args.steps - 1:
        p.error(f"--warmup ({args.warmup}) must be at least 1 and leave 2 or more of the {args.steps} steps")
    if args.sched_trace < 0:
        p.error(f"--sched-trace ({args.sched_trace}) must be 0 (off) or a number of seconds")
    if args.sched_trace and (why := schedtrace.unavailable()):
        p.error(f"--sched-trace: {why}; run without it")
    if args.pin:
        if (os.cpu_count() or 1) < 2:
            p.error("--pin needs 2 cores or more (workers on core 1, the rest on core 0)")
        os.sched_setaffinity(0, {0})
    grpo = job_config(p, args)
    t0 = time.time()
    res = run(systems, args.reps, args.steps, args.warmup, args.ckpt_every, grpo, trace_s=args.sched_trace,
              pin=args.pin)
    res["grpo"] = grpo
    path = save_result("overhead", res, argv, t0, args.out)
    print()
    print(render(res["summary"]))
    print(f"\nwrote {path}")
    return 0
