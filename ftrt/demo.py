"""``ftrt demo``: GRPO on three local nodes that loses one, keeps training, and takes it back.

``ftrt demo --fleet`` runs the same job with its rollouts served by a fleet of two rollout servers
(``ftrt rollout serve``; docs/rollout.md): one server is killed and another added midway, and the
summary shows that no trainer process restarted.

It starts an embedded etcd and three agents (``ftrt launch``, one per simulated node, one worker
each) training the built-in GRPO (``-m ftrt.grpo``) with a checkpoint in memory every step and
on disk every few, SIGKILLs one node (agent and worker) partway, shows the survivors keeping their
processes and continuing at world size 2, starts the node again to show it rejoining, and
prints a summary. Everything is in ``--out``: ``metrics.jsonl`` (rank 0's line per step),
``summary.json``, ``timeline.png`` and the agents' logs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ftrt.helptext import help_summary
from ftrt.chaos.local import LocalNode, read_jsonl, wait_until
from ftrt.errors import ConfigError, FtrtError
from ftrt.store.etcd_server import EtcdServer


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


_lines = read_jsonl

MIN_STEPS = 20
"""The fewest steps the demo runs: a node is killed a quarter in, and the job must outlast its return."""

PROGRESS_EVERY_S = 10.0


class _Watch:
    """The demo's waits. Each gives up at once, with the agents' own reason, when the job failed
    (an agent still meant to run exited with an error), and says every
    :data:`PROGRESS_EVERY_S` seconds how far training got, so a wait never looks like a hang."""

    def __init__(self, agents: dict[str, LocalNode], metrics: Path, steps: int, deadline: float, out: Path) -> None:
        self.agents, self.metrics, self.steps, self.deadline, self.out = agents, metrics, steps, deadline, out
        self.killed: set[str] = set()
        self._said = time.monotonic()

    def until(self, pred, what: str):
        """``pred()``'s first truthy value (see the class docstring)."""
        def check():
            value = pred()
            if value:
                return value
            self._fail_if_failed()
            if time.monotonic() - self._said >= PROGRESS_EVERY_S:
                self._said = time.monotonic()
                lines = _lines(self.metrics)
                done = (f"step {lines[-1]['step'] + 1} of {self.steps} done, world size {lines[-1]['world_size']}"
                        if lines else "no step done yet")
                _say(f"waiting for {what}: {done}")
            return None

        return wait_until(check, max(1.0, self.deadline - time.monotonic()), what)

    def _fail_if_failed(self) -> None:
        for nid, agent in self.agents.items():
            code = None if nid in self.killed or agent.alive() else agent.proc.returncode
            if code not in (None, 0):
                said = [ln for ln in agent.log().splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
                raise FtrtError(f"The demo's job failed: {nid}'s agent exited with code {code}"
                                + (f" ({said[-1].strip().rstrip('.')})" if said else "")
                                + f". Agent logs are in {self.out}/.")


def _closed_etcd(out: Path) -> tuple[EtcdServer, list[str]]:
    """The demo's etcd, closed as ``ftrt etcd`` is (TLS, client certificates from a CA made in a
    private folder of ``out``), and the ``--etcd*`` flags its clients need."""
    from ftrt.store.certs import tls_dir

    etcd = EtcdServer(name="ftrt-demo", unsafe_no_fsync=True, log_path=str(out / "etcd.log"),
                      tls=tls_dir(out / "etcd-tls", ("ftrt",))).start()
    return etcd, ["--etcd", etcd.url, *etcd.access().flags()]


def _restore_tier(agents, world: int) -> str | None:
    """Where the trainer says it restored from at world size ``world`` (its log line), if it did."""
    import re

    for a in agents:
        m = re.search(rf"resumed at step \d+ of \d+ \(world size {world}, from (\w+)\)", a.log())
        if m:
            return m.group(1)
    return None


def run_demo(out: Path, *, nodes: int = 3, steps: int = 150, kill_at: int | None = None, rejoin: bool = True,
             timeout: float = 170.0) -> dict:
    """Run the demo and return its summary (also written to ``out/summary.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json", "timeline.png"):
        (out / stale).unlink(missing_ok=True)
    ckpt = out / "checkpoints"
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    kill_at = steps // 4 if kill_at is None else kill_at
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    started = time.time()
    etcd, etcd_flags = _closed_etcd(out)
    _say(f"embedded etcd on {etcd.url}; starting {nodes} agents (nodes), one GRPO worker each")
    launch = [
        *etcd_flags, "--job-id", "demo", "--nnodes", f"2:{nodes}", "--lease-ttl", "2",
        "--first-round-wait", "10", "-m", "ftrt.grpo", f"steps={steps}", "prompts_per_step=30",
        f"metrics_path={metrics}", f"checkpoint.url={ckpt}", "checkpoint.interval=10",
        "checkpoint.memory_interval=1", "progress=none",
    ]
    agents = {f"node{i}": LocalNode(out, f"node{i}", launch).start() for i in range(nodes)}
    summary: dict = {"recovered": False, "recovery_s": None, "rejoin_s": None}
    events: list[tuple[float, str]] = []
    watch = _Watch(agents, metrics, steps, deadline, out)
    try:
        watch.until(lambda: any(x["world_size"] == nodes for x in _lines(metrics)),
                    f"GRPO training at world size {nodes}")
        _say(f"training GRPO at world size {nodes} (task: reverse 6 symbols; reward 1.0 = all right)")
        watch.until(lambda: any(x["step"] >= kill_at for x in _lines(metrics)), f"step {kill_at}")
        victim = "node1"
        last = _lines(metrics)[-1]
        watch.killed.add(victim)
        killed_at = agents[victim].kill()
        events.append((killed_at, f"{victim} killed"))
        _say(f"SIGKILLed {victim} (agent and worker) after step {last['step']} (reward {last['reward_mean']:.2f})")
        first = watch.until(
            lambda: next((x for x in _lines(metrics) if x["world_size"] == nodes - 1 and x["time"] > killed_at), None),
            "the survivors training at the smaller world")
        summary["recovery_s"] = round(first["time"] - killed_at, 3)
        summary["recovered"] = True
        summary["restored_from"] = _restore_tier(agents.values(), nodes - 1)
        summary["kept_in_place"] = any("kept in place at step" in a.log() for a in agents.values())
        how = ("kept their processes (in place)" if summary["kept_in_place"] else
               f"restored from {summary['restored_from'] or 'a checkpoint'}")
        _say(f"the survivors {how} and finished step {first['step']} at world size {nodes - 1}, "
             f"{summary['recovery_s']:.2f} s after the kill")
        if rejoin:
            again = LocalNode(out, victim, launch)
            again.log_path = out / f"agent-{victim}-rejoin.log"
            agents[victim] = again.start()
            watch.killed.discard(victim)
            events.append((again.started_at, f"{victim} restarted"))
            _say(f"{victim} starts again: it warms up while the others keep training, then joins")
            grown = watch.until(
                lambda: next((x for x in _lines(metrics) if x["world_size"] == nodes and x["time"] > again.started_at),
                             None) or not any(a.alive() for nid, a in agents.items() if nid != victim),
                "the world to grow back",
            )
            if isinstance(grown, dict):
                events.append((grown["time"], f"{victim} rejoined"))
                summary["rejoin_s"] = round(grown["time"] - again.started_at, 3)
                _say(f"world size is {nodes} again at step {grown['step']}, {summary['rejoin_s']:.2f} s "
                     f"after {victim}'s agent started")
            else:
                _say("the job finished before the node was warm enough to rejoin")
        _say(f"training on to step {steps}")
        watch.until(lambda: not any(a.alive() for a in agents.values()), "the job to finish")
        codes = {nid: a.wait(1.0) for nid, a in agents.items()}
    finally:
        for a in agents.values():
            a.cleanup()
        etcd.stop()
    lines = _lines(metrics)
    steps_seen = [x["step"] for x in lines]
    worlds: list[int] = []
    for x in lines:
        if not worlds or worlds[-1] != x["world_size"]:
            worlds.append(x["world_size"])
    last10 = [x["reward_mean"] for x in lines[-10:]]
    ledger = [i for x in lines for i in x["prompt_ids"]]
    summary.update(
        world_sizes=worlds,
        steps_redone=lines[-1]["redone"] if lines else 0,
        steps_missing=sorted(set(range(steps)) - set(steps_seen)),
        prompts_repeated=len(ledger) - len(set(ledger)),
        final_step=max(steps_seen) if steps_seen else -1,
        final_reward=round(sum(last10) / len(last10), 4) if last10 else None,
        first_reward=round(sum(x["reward_mean"] for x in lines[:10]) / len(lines[:10]), 4) if lines else None,
        exit_codes=codes,
        wall_s=round(time.time() - started, 1),
        out=str(out),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if lines:
        from ftrt.plots import timeline_png

        timeline_png(out / "timeline.png", lines, events,
                     title=f"ftrt demo: GRPO on {nodes} nodes, one killed and restarted")
    return summary


def run_fleet_demo(out: Path, *, nodes: int = 3, steps: int = 150, timeout: float = 300.0) -> dict:
    """The demo's job with its rollouts from 2 rollout servers: one killed, one added (summary also in
    ``out/summary.json``)."""
    from ftrt.chaos.faults.rollout import RolloutServers

    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json", "timeline.png"):
        (out / stale).unlink(missing_ok=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    started = time.time()
    etcd, etcd_flags = _closed_etcd(out)
    fleet = RolloutServers(out, "demo", etcd.url, "demo", "127.0.0.1", 2.0, etcd_flags[2:])
    agents: dict[str, LocalNode] = {}
    launch = [
        *etcd_flags, "--job-id", "demo", "--nnodes", f"{nodes}", "--lease-ttl", "2",
        "--first-round-wait", "10", "-m", "ftrt.grpo", f"steps={steps}", "prompts_per_step=30",
        f"metrics_path={metrics}", "checkpoint.url=null", "rollout.mode=fleet", "progress=none",
    ]
    events: list[tuple[float, str]] = []
    try:
        _say(f"embedded etcd on {etcd.url}; starting 2 rollout servers and {nodes} agents (nodes), one GRPO "
             "worker each, sampling through the fleet")
        for i in range(2):
            fleet.start(f"rollout{i}")
        agents.update({f"node{i}": LocalNode(out, f"node{i}", launch).start() for i in range(nodes)})
        watch = _Watch(agents, metrics, steps, deadline, out)
        watch.until(lambda: len(_lines(metrics)) >= 1, "the first GRPO step")
        _say(f"training GRPO at world size {nodes}; every step's prompt groups go to the rollout servers")
        watch.until(lambda: any(x["step"] >= steps // 4 for x in _lines(metrics)), f"step {steps // 4}")
        fleet.procs["rollout0"].kill()
        events.append((time.time(), "rollout0 killed"))
        _say(f"SIGKILLed rollout server rollout0 after step {_lines(metrics)[-1]['step']}: its prompt groups go "
             "to rollout1")
        watch.until(lambda: any(x["step"] >= steps // 2 for x in _lines(metrics)), f"step {steps // 2}")
        fleet.start("rollout2")
        events.append((time.time(), "rollout2 added"))
        _say("started rollout server rollout2: it gets the current weights, then prompt groups")
        watch.until(lambda: not any(a.alive() for a in agents.values()), "the job to finish")
        codes = {nid: a.wait(1.0) for nid, a in agents.items()}
    finally:
        for a in agents.values():
            a.cleanup()
        fleet.stop_all()
        etcd.stop()
    lines = _lines(metrics)
    ledger = [i for x in lines for i in x["prompt_ids"]]
    last10 = [x["reward_mean"] for x in lines[-10:]]
    summary = {
        "fleet": True, "trainer_restarts": lines[-1]["resumes"] if lines else None,
        "world_sizes": sorted({x["world_size"] for x in lines}),
        "redispatched": sum(x.get("redispatched", 0) for x in lines),
        "servers_over_time": [x.get("rollout_servers") for x in lines[:: max(1, len(lines) // 12)]],
        "final_step": max((x["step"] for x in lines), default=-1),
        "steps_missing": sorted(set(range(steps)) - {x["step"] for x in lines}),
        "prompts_repeated": len(ledger) - len(set(ledger)),
        "first_reward": round(sum(x["reward_mean"] for x in lines[:10]) / len(lines[:10]), 4) if lines else None,
        "final_reward": round(sum(last10) / len(last10), 4) if last10 else None,
        "median_push_s": sorted(x.get("push_s", 0.0) for x in lines)[len(lines) // 2] if lines else None,
        "exit_codes": codes, "wall_s": round(time.time() - started, 1), "out": str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if lines:
        from ftrt.plots import timeline_png

        timeline_png(out / "timeline.png", lines, events,
                     title=f"ftrt demo --fleet: GRPO on {nodes} nodes, rollouts from a fleet (one server killed, one added)")
    return summary


def _fleet_summary(s: dict, steps: int) -> int:
    ok = (s["trainer_restarts"] == 0 and not s["steps_missing"] and not s["prompts_repeated"]
          and all(c == 0 for c in s["exit_codes"].values()))
    print()
    print("ftrt demo --fleet summary")
    print(f"  trainer untouched            : {'yes' if s['trainer_restarts'] == 0 else 'NO'} "
          f"({s['trainer_restarts']} restarts; world size {', '.join(map(str, s['world_sizes']))} throughout)")
    print(f"  rollout servers over time    : {' -> '.join(map(str, s['servers_over_time']))} "
          f"(one killed, one added); {s['redispatched']} prompt groups sent again")
    print(f"  steps trained                : {s['final_step'] + 1} of {steps}, {len(s['steps_missing'])} missing, "
          f"{s['prompts_repeated']} prompts trained twice")
    print(f"  mean reward                  : {s['first_reward']} (first 10 steps) -> {s['final_reward']} (last 10)")
    print(f"  wall time                    : {s['wall_s']} s; metrics, summary.json, timeline.png in {s['out']}/")
    return 0 if ok else 1


def demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ftrt demo", description=help_summary(__doc__))
    p.add_argument("--out", default="ftrt-demo", help="output directory (default ./ftrt-demo)")
    p.add_argument("--steps", type=int, default=150, help="GRPO steps (default 150)")
    p.add_argument("--no-rejoin", dest="rejoin", action="store_false", help="do not restart the lost node")
    p.add_argument("--fleet", action="store_true", help="rollouts from 2 rollout servers instead: one is killed "
                   "and another added midway, and no trainer process restarts")
    args = p.parse_args(argv)
    if args.steps < MIN_STEPS:
        raise ConfigError(f"ftrt demo --steps {args.steps}: give at least {MIN_STEPS} (a node is killed a quarter "
                          "of the way in, and the job must outlast its return); the default is 150.")
    if args.fleet:
        try:
            return _fleet_summary(run_fleet_demo(Path(args.out), steps=args.steps), args.steps)
        except AssertionError as exc:
            raise FtrtError(f"The demo did not complete: {exc}. Logs are in {args.out}/.") from None
    try:
        s = run_demo(Path(args.out), steps=args.steps, rejoin=args.rejoin)
    except AssertionError as exc:  # a wait ran out: say what did not happen, no traceback
        raise FtrtError(f"The demo did not complete: {exc}. Agent logs are in {args.out}/.") from None
    ok = (s["recovered"] and not s["steps_missing"] and not s["prompts_repeated"]
          and all(c == 0 for c in s["exit_codes"].values()))
    print()
    print("ftrt demo summary")
    print(f"  recovered from the node loss : {'yes' if s['recovered'] else 'NO'}"
          f" (survivors training {s['recovery_s']} s after the kill)")
    if s["rejoin_s"] is not None:
        print(f"  node rejoined                : world grew back {s['rejoin_s']} s after its agent started")
    print(f"  world sizes over time        : {' -> '.join(map(str, s['world_sizes']))}")
    print(f"  steps trained                : {s['final_step'] + 1} of {args.steps}, "
          f"{s['steps_redone']} redone after restores, {len(s['steps_missing'])} missing, "
          f"{s['prompts_repeated']} prompts trained twice")
    print(f"  mean reward                  : {s['first_reward']} (first 10 steps) -> {s['final_reward']} (last 10)")
    print(f"  agents' exit codes           : {s['exit_codes']}")
    print(f"  wall time                    : {s['wall_s']} s; metrics, summary.json, timeline.png in {s['out']}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(demo_main(sys.argv[1:]))
