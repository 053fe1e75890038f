"""Goodput under a node-loss schedule: GRPO under ftrt beside torchrun with DCP checkpoints.

The job is the built-in GRPO trainer (``python -m ftrt.grpo``) on 3 simulated nodes of 1 worker,
``--nnodes 2:3``. Once it trains, a node is SIGKILLed (agent and workers, like a machine dying)
every ``--every`` seconds and started again ``--down`` seconds later (its replacement rejoins);
the victims alternate between the two nodes that do not host torchrun's rendezvous store (killing
that one ends a torchrun job for good; ftrt has no such node, but both get the same schedule).

- ftrt: ``ftrt launch`` agents on a local etcd; a checkpoint in memory (replicated to a peer)
  every step and to local disk every ``--ckpt-every`` steps.
- torchrun: c10d rendezvous at its best settings (``python -m bench recovery`` explains them);
  the trainer's checkpointer without a memory tier, i.e. a DCP checkpoint (staged and written in
  the background, committed atomically) to local disk every ``--ckpt-every`` steps. A restart
  resumes from the last one.

Goodput = productive step time / wall time, over a window of ``--duration`` seconds that starts
once the job trains and, when faults are scheduled, ftrt's spare workers are warm (start-up is
paid once per job; each run reports it as ``startup_s``). Each run also reports ``steal_s``, the
CPU the hypervisor took from this VM during the window: a run the host stalled shows it there.
Productive step time is the summed duration of the steps that stand at the end: a step a restart
threw away (trained after the last checkpoint and redone) counts as lost, as does every stall.
Per fault the table gives the longest pause in training after the kill and after the rejoin.

``--every 60,600,none`` runs the schedule at each fault interval in turn (``none``: no fault) and
answers the user's question: how many steps each system trains in the same wall time, at that
fault rate. Both trainers are told the fault interval (``checkpoint.mtbf``), so ``auto``
checkpoint cadences are at their best for it (``--ckpt-every auto``: both systems' storage
cadence too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import schedtrace
from bench.recovery import Cluster
from ftrt import _diag, progress
from ftrt.chaos.local import read_jsonl, wait_until

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("ftrt", "ftrt-inplace", "torchrun", "torchft")
"""``ftrt``: ``--recovery restart`` (every round change restarts the workers, the series measured
before in-place recovery); ``ftrt-inplace``: the default, the survivors keep their processes;
``torchft``: its replica groups (:mod:`bench.torchft_grpo_worker`)."""
GRPO = {
    "prompts_per_step": 64, "group_size": 16, "model.d_model": 128, "model.n_layers": 2, "model.n_heads": 4,
    "progress": "none", "steps": 1_000_000,
}
"""The job: the default task on a small policy, ~0.4 s a step at world size 2 and ~0.6 s at 3 on
2 cores. ``--grpo`` overrides it (e.g. ``model.d_model=64 group_size=8`` for ~60 ms steps)."""
VICTIMS = ("n1", "n2")


def add_job_options(p: argparse.ArgumentParser, name: str) -> None:
    """The options the GRPO benchmarks share: checkpoint interval, config overrides, result path."""
    p.add_argument("--ckpt-every", type=_interval, default=10,
                   help="steps between storage checkpoints, or auto (default 10)")
    p.add_argument("--grpo", action="append", default=[], metavar="KEY=VALUE",
                   help="override the job's GRPO config (repeatable), e.g. --grpo model.d_model=32")
    p.add_argument("--out", default=None, help=f"JSON result path (default bench/results/{name}-<time>.json)")


def _interval(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps >= 1 or auto")
    return n


def job_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The GRPO job with the ``--grpo KEY=VALUE`` overrides (the trainer validates them at start)."""
    out = dict(GRPO)
    for item in args.grpo:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--grpo {item!r} is not KEY=VALUE (e.g. --grpo model.d_model=32)")
        out[key] = value
    return out


def save_result(name: str, res: dict, argv: list[str], t0: float, out: str | None) -> Path:
    """Stamp ``res`` with date, machine, command and wall time; write it as JSON; return the path."""
    res.update(date=time.strftime("%Y-%m-%d %H:%M"), machine=f"{os.cpu_count()} cores",
               command=f"python -m bench {name} " + " ".join(argv), wall_s=round(time.time() - t0))
    path = Path(out or ROOT / "bench" / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    return path


def run_one(system: str, *, duration: float, every: float, down: float, ckpt_every: int | str, grpo: dict,
            mtbf: float | None = None, log=print) -> dict:
    """Run the schedule once for ``system``; return its goodput, faults and step timeline.

    The window of ``duration`` seconds starts once the job trains (3 steps) and, when faults are
    scheduled, ftrt's spare workers are warm: start-up is paid once per job (and reported as
    ``startup_s``), while the window stands for the days a job runs. ``mtbf`` is passed to ftrt's
    agents (``--mtbf``) as the trainer's ``checkpoint.mtbf`` is to both systems.
    """
    work = Path(tempfile.mkdtemp(prefix=f"bench-goodput-{system}-"))
    metrics = work / "metrics.jsonl"
    overrides = {**grpo, "metrics_path": str(metrics), "checkpoint.url": str(work / "ckpt"),
                 "checkpoint.interval": ckpt_every, "checkpoint.keep": 2}
    config = [f"{k}={v}" for k, v in overrides.items()]
    if system == "torchft":
        from bench.torchft_baseline import GRPO_WORKER, TorchftCluster

        c: Cluster | TorchftCluster = TorchftCluster(work, nnodes="2:3")
        script = [str(GRPO_WORKER), *config]
    else:
        extra = (*(("--mtbf", f"{mtbf:g}") if mtbf is not None else ()),
                 *(("--recovery", "restart") if system == "ftrt" else ()))
        c = Cluster("ftrt" if system.startswith("ftrt") else system, work, nnodes="2:3", max_restarts=1000,
                    launch_extra=extra)
        script = ["-m", "ftrt.grpo", *config]
    faults: list[dict] = []
    try:
        t_launch = time.time()
        for name in ("n0", "n1", "n2"):
            c.add(name, script)
        wait_until(lambda: len(read_jsonl(metrics)) >= 3, 300, f"{system}'s job to train")
        if math.isfinite(every):
            wait_until(c.spares_warm, 300, "spare workers to be warm", interval=0.25)
        first = read_jsonl(metrics)[0]
        startup = first["time"] - first["step_s"] - t_launch
        t_first = time.time()
        t_end = t_first + duration
        steal0 = schedtrace.steal_seconds()
        kills = [t_first + every * k for k in range(1, int(duration // every) + 1) if every * k + down < duration]
        pending_restart: tuple[float, str] | None = None
        while time.time() < t_end:
            now = time.time()
            if kills and now >= kills[0]:
                kills.pop(0)
                victim = VICTIMS[len(faults) % len(VICTIMS)]
                t = c.nodes[victim].kill()
                c.nodes[victim].cleanup()
                faults.append({"node": victim, "killed_at": round(t - t_first, 3)})
                _diag.mark("bench.killed", node=victim, at=t)
                log(f"[goodput] {system}: {t - t_first:6.1f} s  killed {victim}")
                pending_restart = (t + down, victim)
            if pending_restart and now >= pending_restart[0]:
                victim = pending_restart[1]
                c.add(victim, script)
                _diag.mark("bench.restarted", node=victim)
                faults[-1]["restarted_at"] = round(time.time() - t_first, 3)
                log(f"[goodput] {system}: {time.time() - t_first:6.1f} s  restarted {victim}")
                pending_restart = None
            time.sleep(0.05)
        lines = [x for x in read_jsonl(metrics) if t_first < x["time"] <= t_end]
        steal = schedtrace.steal_seconds() - steal0
        if steal > 1.0:
            log(f"[goodput] {system}: the host took {steal:.1f} s of CPU from this VM during the run (steal)")
    finally:
        c.close()
        if os.environ.get("FTRT_BENCH_KEEP"):  # keep the agents' and workers' logs to explain a run
            log(f"[goodput] {system}: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {**summarize(system, lines, faults, t_first, duration, ckpt_every), "startup_s": round(startup, 2),
            "steal_s": round(steal, 2)}


def summarize(system: str, lines: list[dict], faults: list[dict], t_first: float, duration: float,
              ckpt_every: int) -> dict:
    """Goodput and per-fault pauses from the steps that stand (times relative to the first step)."""
    ends = [x["time"] - t_first for x in lines]
    productive = sum(x["step_s"] for x in lines)
    marks = [f["killed_at"] for f in faults] + [duration]
    for i, f in enumerate(faults):
        f["pause_after_kill_s"] = round(_longest_gap(ends, f["killed_at"], f.get("restarted_at", marks[i + 1])), 3)
        f["stall_after_kill_s"] = _switch_stall(lines, ends, f["killed_at"], marks[i + 1], grows=False)
        if "restarted_at" in f:
            f["pause_after_rejoin_s"] = round(_longest_gap(ends, f["restarted_at"], marks[i + 1]), 3)
            f["stall_at_rejoin_s"] = _switch_stall(lines, ends, f["restarted_at"], marks[i + 1], grows=True)
    steady = [x["step_s"] for t, x in zip(ends, lines) if t < marks[0]][5:] or [x["step_s"] for x in lines]
    return {
        "system": system, "goodput": round(productive / duration, 4), "productive_s": round(productive, 1),
        "wall_s": duration, "steps": len(lines), "redone": lines[-1]["redone"] if lines else 0,
        "resumes": lines[-1]["resumes"] if lines else 0, "ckpt_every": ckpt_every,
        "median_step_s": round(sorted(steady)[len(steady) // 2], 4) if steady else None,
        "faults": faults,
        "timeline": [[round(t, 2), x["step"], x["world_size"]] for t, x in zip(ends, lines)],
    }


def _switch_stall(lines: list[dict], ends: list[float], t0: float, t1: float, *, grows: bool) -> float | None:
    """Seconds the switch to a new world cost beyond its first step: the gap between the last
    step of the old world and the first of the new one, less that step's own time. After a kill
    the first step after ``t0`` is the new world's (the work lost mid-step counts as stall); at a
    rejoin, the first step in (``t0``, ``t1``] at a larger world than the step before it."""
    for k in range(1, len(lines)):
        if not t0 < ends[k] <= t1:
            continue
        if not grows or lines[k]["world_size"] > lines[k - 1]["world_size"]:
            return round(ends[k] - ends[k - 1] - lines[k]["step_s"], 3)
    return None


def _longest_gap(ends: list[float], t0: float, t1: float) -> float:
    """The longest stretch in [t0, t1] without a step end (from the fault until training resumes)."""
    points = [t0, *(t for t in ends if t0 < t <= t1), t1]
    return max(b - a for a, b in zip(points, points[1:]))


def render(rows: list[dict]) -> str:
    lines = [f"{'system':<10}{'goodput':>9}{'steps':>7}{'redone':>8}{'step (median)':>15}"
             f"{'pause after kill':>18}{'after rejoin':>14}{'stall: kill':>13}{'rejoin':>9}"]
    for r in rows:
        faults = r["faults"]
        kill = [f["pause_after_kill_s"] for f in faults]
        rejoin = [f["pause_after_rejoin_s"] for f in faults if "pause_after_rejoin_s" in f]
        stall_kill = [f["stall_after_kill_s"] for f in faults if f.get("stall_after_kill_s") is not None]
        stall_join = [f["stall_at_rejoin_s"] for f in faults if f.get("stall_at_rejoin_s") is not None]
        med = (lambda v: f"{sorted(v)[len(v) // 2]:.2f} s" if v else "-")
        lines.append(f"{r['system']:<10}{r['goodput']:>9.1%}{r['steps']:>7}{r['redone']:>8}"
                     f"{r['median_step_s']:>13.3f} s{med(kill):>18}{med(rejoin):>14}"
                     f"{med(stall_kill):>13}{med(stall_join):>9}")
    by = {r["system"]: r for r in rows}
    for mine, base in _pairs(list(by)):
        a, b = by[mine], by[base]
        if b["goodput"]:
            lines.append(f"{mine} / {base} goodput: {a['goodput'] / b['goodput']:.2f}x; steps trained: "
                         f"{a['steps']} vs {b['steps']} ({a['steps'] / max(b['steps'], 1):.2f}x)")
    lines.append("(pauses: median over the faults of the longest stretch without a step after the kill, "
                 "and after the node restarted; stalls: the gap at the switch to the new world less "
                 "that world's first step, i.e. what the switch itself cost)")
    return "\n".join(lines)


def parse_every(text: str) -> list[float | None]:
    """``"60,600,none"`` -> [60.0, 600.0, None] (None: no fault at all)."""
    out: list[float | None] = []
    for item in (x.strip() for x in text.split(",")):
        if item in ("none", "never"):
            out.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            value = 0.0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} is not a number of seconds > 0 or none")
        out.append(value)
    return out


def duration_for(every: float | None, duration: float, down: float, tail: float = 90.0) -> float:
    """Seconds to train at one fault interval: ``duration``, or long enough for one kill, its
    rejoin and ``tail`` seconds after it when ``duration`` is too short for that."""
    if every is None or every + down < duration:
        return duration
    return every + down + tail


BASELINES = ("torchrun", "torchft")


def _pairs(systems: list[str]) -> list[tuple[str, str]]:
    """(ftrt system, baseline) for every pair of the two present, in the order given."""
    return [(a, b) for a in systems if a.startswith("ftrt") for b in systems if b in BASELINES]


def series(rows: list[dict]) -> list[dict]:
    """Per fault interval: steps trained by each system in the same wall time, and their ratios.

    ``<system>_steps`` and ``<system>_goodput`` for each system; ``ratios["A/B"]`` for each ftrt
    system A and baseline B (``steps_ratio``: ftrt over torchrun). With repeats (rows carrying
    ``rep``), steps and goodput are means over the repeats, a ratio is the ratio of the summed
    steps, and ``pair_ratios["A/B"]`` lists each repeat's own (``pair_ratios``: ftrt over torchrun)."""
    out = []
    for every in dict.fromkeys(r["every"] for r in rows):
        same = [r for r in rows if r["every"] == every]
        systems = list(dict.fromkeys(r["system"] for r in same))
        by = {s: [r for r in same if r["system"] == s] for s in systems}
        entry = {"every": every, "wall_s": same[0]["wall_s"],
                 **{f"{k}_steps": round(sum(r["steps"] for r in v) / len(v), 1) if len(v) > 1 else v[0]["steps"]
                    for k, v in by.items()},
                 **{f"{k}_goodput": round(sum(r["goodput"] for r in v) / len(v), 4) for k, v in by.items()}}
        pairs = {r.get("rep", 0): {} for r in same}
        for r in same:
            pairs[r.get("rep", 0)][r["system"]] = r["steps"]
        ratios, per_rep = {}, {}
        for mine, base in _pairs(systems):
            if not sum(r["steps"] for r in by[base]):
                continue
            ratios[f"{mine}/{base}"] = round(sum(r["steps"] for r in by[mine]) / sum(r["steps"] for r in by[base]), 4)
            if len(pairs) > 1:
                per_rep[f"{mine}/{base}"] = [round(p[mine] / p[base], 4) for p in pairs.values()
                                             if p.get(base) and mine in p]
        if ratios:
            entry["ratios"] = ratios
        if "ftrt/torchrun" in ratios:
            entry["steps_ratio"] = ratios["ftrt/torchrun"]
            if per_rep:
                entry["pair_ratios"] = per_rep["ftrt/torchrun"]
        if per_rep:
            entry["all_pair_ratios"] = per_rep
        out.append(entry)
    return out


def run_order(systems: list[str], reps: int) -> list[tuple[int, str]]:
    """(repeat, system) in the order to run them: the order flips each repeat (A B, B A, ...), so
    that a drift of the machine's speed over the runs does not favour one system."""
    return [(rep, s) for rep in range(reps) for s in (systems if rep % 2 == 0 else systems[::-1])]


def render_series(entries: list[dict]) -> str:
    systems = list(dict.fromkeys(k[:-len("_steps")] for e in entries for k in e if k.endswith("_steps")))
    names = list(dict.fromkeys(n for e in entries for n in e.get("ratios", {})))
    lines = ["fault every    wall" + "".join(f"{s + ' steps':>20}" for s in systems)
             + "".join(f"{n:>28}" for n in names) + "".join(f"{s + ' goodput':>20}" for s in systems)]
    for e in entries:
        every = "none" if e["every"] is None else f"{e['every']:g} s"
        row = f"{every:>11}{e['wall_s']:>7.0f}s" + "".join(f"{e.get(s + '_steps', '-'):>20}" for s in systems)
        for n in names:
            ratio = f"{e['ratios'][n]:.3f}" if n in e.get("ratios", {}) else "-"
            reps = e.get("all_pair_ratios", {}).get(n)
            if reps:
                ratio += f" ({', '.join(f'{x:.3f}' for x in reps)})"
            row += f"{ratio:>28}"
        row += "".join(f"{e[s + '_goodput']:>20.1%}" if s + "_goodput" in e else f"{'-':>20}" for s in systems)
        lines.append(row)
    lines.append("(steps trained in the same wall time, from each system's first step; ratios: steps of the ftrt "
                 "system over the baseline's, and each repeat's own in brackets)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench goodput", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=300.0,
                   help="seconds of training per system and fault interval (default 300; raised to "
                        "EVERY + DOWN + 90 s where one kill would not fit otherwise)")
    p.add_argument("--every", type=parse_every, default=[60.0],
                   help="seconds between node kills, or a comma-separated list of them with none for a "
                        "fault-free run, e.g. 60,600,none (default 60)")
    p.add_argument("--down", type=float, default=10.0, help="seconds a killed node stays down (default 10)")
    p.add_argument("--no-mtbf", dest="tell_mtbf", action="store_false",
                   help="do not tell the trainers the fault interval (by default checkpoint.mtbf=EVERY for "
                        "both systems, so that an auto checkpoint cadence is at its best for the schedule)")
    p.add_argument("--systems", default="ftrt-inplace,torchrun",
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (default ftrt-inplace,torchrun; torchft "
                        "needs pip install torchft==0.2.0)")
    p.add_argument("--plot", default=None, help="write a PNG here: steps and world size over time (one fault "
                   "interval), or steps trained against the fault interval (several; each timeline beside it)")
    p.add_argument("--reps", type=int, default=1,
                   help="runs of each system per fault interval, the order flipped each repeat (default 1); "
                        "the series reports summed steps and each pair's ratio")
    add_job_options(p, "goodput")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be 1 or more, not {args.reps}")
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems names {unknown}; choose from {list(SYSTEMS)}")
    for every in args.every:
        if every is not None and every <= args.down:
            p.error(f"--every ({every:g}) must exceed --down ({args.down}): a node is restarted before the next kill")
    grpo = job_config(p, args)
    t0 = time.time()
    rows = []
    with progress.bar(len(args.every) * len(systems) * args.reps, "goodput", "run") as shown:
        for every in args.every:
            job = dict(grpo)
            if args.tell_mtbf and every is not None:
                job.setdefault("checkpoint.mtbf", every)
            duration = duration_for(every, args.duration, args.down)
            for rep, system in run_order(systems, args.reps):
                r = run_one(system, duration=duration, every=math.inf if every is None else every, down=args.down,
                            ckpt_every=args.ckpt_every, grpo=job,
                            mtbf=every if args.tell_mtbf and system.startswith("ftrt") else None)
                r["every"] = every
                r["rep"] = rep
                print(json.dumps({k: v for k, v in r.items() if k != "timeline"}), flush=True)
                rows.append(r)
                shown.update()
    entries = series(rows)
    path = save_result("goodput", {"rows": rows, "series": entries, "grpo": grpo}, argv, t0, args.out)
    if args.plot:
        from bench.plots import goodput_png, steps_vs_interval_png

        plot = Path(args.plot)
        first = [r for r in rows if r["rep"] == 0]  # the timelines of the first repeat
        if len(args.every) == 1:
            goodput_png(first, plot)
        else:
            steps_vs_interval_png(entries, plot)
            for every in args.every:
                name = plot.with_name(f"{plot.stem}-every{'none' if every is None else f'{every:g}'}{plot.suffix}")
                goodput_png([r for r in first if r["every"] == every], name)
        print(f"wrote {args.plot}")
    for every in args.every:
        print(f"\nfault every {'none' if every is None else f'{every:g} s'}:")
        print(render([r for r in rows if r["every"] == every]))
    print()
    print(render_series(entries))
    print(f"\nwrote {path}")
    return 0
