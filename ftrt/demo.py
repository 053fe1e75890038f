"""``ftrt demo``: an elastic job on three local nodes that loses one and keeps going.

It starts an embedded etcd and three agents (``ftrt launch``, one per simulated node) running a
small gloo DDP job, SIGKILLs one node (agent and workers) partway, shows the survivors continuing
at world size 2, starts the node again to show it rejoining, and prints a summary. Everything it
did is in ``--out``: ``metrics.jsonl`` (one line per rank and step), ``summary.json`` and the agents'
logs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ftrt.chaos.local import LocalNode, StepLog, wait_until
from ftrt.errors import FtrtError
from ftrt.store.etcd_server import EtcdServer


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _last(log: StepLog) -> dict | None:
    lines = [x for x in log.lines() if x["rank"] == 0]
    return lines[-1] if lines else None


def run_demo(out: Path, *, nodes: int = 3, steps: int = 1000, step_time: float = 0.05,
             kill_at: int | None = None, rejoin: bool = True, timeout: float = 170.0) -> dict:
    """Run the demo and return its summary (also written to ``out/summary.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "ckpt.json"):
        (out / stale).unlink(missing_ok=True)
    kill_at = steps // 6 if kill_at is None else kill_at
    log = StepLog(out / "metrics.jsonl")
    deadline = time.monotonic() + timeout
    started = time.time()
    etcd = EtcdServer(name="ftrt-demo", unsafe_no_fsync=True, log_path=str(out / "etcd.log")).start()
    _say(f"embedded etcd on {etcd.endpoint}; starting {nodes} agents (nodes) for job 'demo'")
    launch = [
        "--etcd", etcd.endpoint, "--job-id", "demo", "--nnodes", f"2:{nodes}", "--lease-ttl", "2",
        "-m", "ftrt.examples.ddp_steps", "--steps", str(steps), "--step-time", str(step_time),
        "--progress", str(log.path), "--all-ranks", "--ckpt", str(out / "ckpt.json"),
    ]
    env = {"OMP_NUM_THREADS": "1"}
    agents = {f"node{i}": LocalNode(out, f"node{i}", launch, env=env).start() for i in range(nodes)}
    summary: dict = {"recovered": False, "recovery_s": None, "rejoin_s": None}
    try:
        left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
        wait_until(lambda: log.stepping(world=nodes, ranks=nodes), left(), f"{nodes} ranks stepping")
        _say(f"training at world size {nodes} (workers were pre-started warm, torch imported)")
        try:
            wait_until(lambda: all("spares warm again" in a.log() for a in agents.values()),
                       min(60.0, left()), "spare workers warm")
        except AssertionError:
            _say("spares are still warming; the loss will be handled with a cold start")
        wait_until(lambda: (_last(log) or {}).get("step", -1) >= kill_at, left(), f"step {kill_at}")
        victim = "node1"
        killed_at = agents[victim].kill()
        _say(f"SIGKILLed {victim} (its agent and workers) at step {_last(log)['step']}")
        first = wait_until(lambda: log.stepping(world=nodes - 1, ranks=nodes - 1, since=killed_at),
                           left(), "survivors stepping at the smaller world")
        summary["recovery_s"] = round(max(first.values()) - killed_at, 3)
        summary["recovered"] = True
        _say(f"the survivors are training at world size {nodes - 1}, "
             f"{summary['recovery_s']:.2f} s after the kill")
        if rejoin:
            again = LocalNode(out, victim, launch, env=env)
            again.log_path = out / f"agent-{victim}-rejoin.log"
            agents[victim] = again.start()
            _say(f"{victim} starts again: it warms up while the others keep training, then joins")
            grown = wait_until(
                lambda: log.stepping(world=nodes, ranks=nodes, since=again.started_at)
                or not any(a.alive() for nid, a in agents.items() if nid != victim),
                left(), "the world to grow back",
            )
            if isinstance(grown, dict):
                summary["rejoin_s"] = round(max(grown.values()) - again.started_at, 3)
                _say(f"world size is {nodes} again, {summary['rejoin_s']:.2f} s after {victim}'s agent started")
            else:
                _say("the job finished before the node was warm enough to rejoin")
        codes = {nid: a.wait(max(1.0, deadline - time.monotonic())) for nid, a in agents.items()}
    finally:
        for a in agents.values():
            a.cleanup()
        etcd.stop()
    lines = log.lines()
    rank0 = [x["step"] for x in lines if x["rank"] == 0]
    worlds: list[int] = []
    for x in sorted(lines, key=lambda x: x["time"]):
        if not worlds or worlds[-1] != x["world"]:
            worlds.append(x["world"])
    summary.update(
        world_sizes=worlds,
        steps_redone=len(rank0) - len(set(rank0)),
        steps_missing=sorted(set(range(steps)) - set(rank0)),
        final_step=max(rank0) if rank0 else -1,
        exit_codes=codes,
        wall_s=round(time.time() - started, 1),
        out=str(out),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ftrt demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="ftrt-demo", help="output directory (default ./ftrt-demo)")
    p.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    p.add_argument("--no-rejoin", dest="rejoin", action="store_false", help="do not restart the lost node")
    args = p.parse_args(argv)
    try:
        s = run_demo(Path(args.out), steps=args.steps, rejoin=args.rejoin)
    except AssertionError as exc:  # a wait ran out: say what did not happen, no traceback
        raise FtrtError(f"The demo did not complete: {exc}. Agent logs are in {args.out}/.") from None
    ok = s["recovered"] and not s["steps_missing"] and all(c == 0 for c in s["exit_codes"].values())
    print()
    print("ftrt demo summary")
    print(f"  recovered from the node loss : {'yes' if s['recovered'] else 'NO'}"
          f" (survivors stepping {s['recovery_s']} s after the kill)")
    if s["rejoin_s"] is not None:
        print(f"  node rejoined                : world grew back {s['rejoin_s']} s after its agent started")
    print(f"  world sizes over time        : {' -> '.join(map(str, s['world_sizes']))}")
    print(f"  steps trained                : {s['final_step'] + 1} of {args.steps}, "
          f"{s['steps_redone']} redone, {len(s['steps_missing'])} missing")
    print(f"  agents' exit codes           : {s['exit_codes']}")
    print(f"  wall time                    : {s['wall_s']} s; files in {s['out']}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(demo_main(sys.argv[1:]))
