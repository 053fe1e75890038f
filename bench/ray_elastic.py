"""``python -m bench ray``: ftrt's elastic Ray group against Ray Train v2's elastic mode, the same job on
the same cluster, a Ray node removed every ``--every`` seconds and added back ``--down`` seconds later.

Both systems train the same data-parallel regression (:mod:`ftrt.examples.ray_regression`): one
worker per Ray node, each step a global batch split over the ranks, ``--step-time`` seconds of
stand-in compute per step, gradients summed over gloo. Each runs in a fresh process with its own
:func:`ftrt.integrations.ray.loopback_cluster` of ``--nodes`` raylets (127.0.0.1 only), and its
driver trains from a thread while the main thread removes and adds nodes (Ray's ``Cluster`` must
be driven from the main thread), so a removal lands wherever the job is.

- **ftrt**: :class:`ftrt.integrations.ray.ElasticGroup`. No checkpoints: the survivors keep the
  state in memory and run the step in flight again at the smaller world.
- **Ray Train** (``RAY_TRAIN_V2_ENABLED=1``): ``TorchTrainer`` with ``ScalingConfig(num_workers=(1,
  nodes))``, ``FailureConfig(max_failures=-1)``, a checkpoint every ``--ckpt-every`` steps (rank 0
  writes the state; ``ray.train.report`` only then, the cheapest it allows) and the worker group's
  start timeout lowered to 10 s (its default, 60 s, is what a node loss costs otherwise: the
  controller first tries the old world size). A node loss restarts its worker group, which
  resumes from the newest checkpoint.

Measured from each run's step log (rank 0, or the driver): per fault, the longest pause between
step completions from the node's removal until it is added back (the stall the loss caused; a step
in flight that completes before the survivors notice does not hide it), and from its return until
the next removal; Ray's own detection of the node's death, apart (``ray.nodes()``); over the window
of ``--duration`` seconds after the third step, the steps of progress (the highest step reached:
steps trained again after a rollback are not progress) and the goodput (that progress over what
the fault-free step rate gives in the window). The ratio ftrt/Ray Train of progress is printed and
recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.goodput import _longest_gap, save_result

BATCH = 12
SYSTEMS = ("ftrt", "raytrain")


def _batch(step: int) -> list[int]:
    return list(range(step * BATCH, (step + 1) * BATCH))


class Schedule:
    """Remove the oldest worker node every ``every`` s and add one back ``down`` s later (main thread).
    ``hard``: the node's processes are SIGKILLed (Ray learns it from failed health checks) instead of
    stopped gracefully. Ray's own detection is timed apart: until ``ray.nodes()`` says the node is dead."""

    def __init__(self, cluster, every: float, down: float, hard: bool = False) -> None:
        self.cluster, self.every, self.down, self.hard = cluster, every, down, hard
        self.nodes = list(cluster.worker_nodes)
        self.faults: list[float] = []
        self.detected: list[float | None] = []
        self.adds: list[float] = []

    def _watch(self, victim_id: str | None, since: float) -> str | None:
        """The victim's id while Ray still lists it alive; None once it is seen dead."""
        import ray

        if victim_id is None:
            return None
        if any(n["NodeID"] == victim_id and not n["Alive"] for n in ray.nodes()):
            self.detected[-1] = round(time.time() - since, 3)
            return None
        return victim_id

    def run(self, t0: float, duration: float, stop: threading.Event) -> None:
        due_remove, due_add, watching = t0 + self.every, None, None
        while time.time() < t0 + duration and not stop.is_set():
            now = time.time()
            watching = self._watch(watching, self.faults[-1] if self.faults else now)
            if now >= due_remove and len(self.nodes) > 1:
                victim = self.nodes.pop(0)
                self.faults.append(time.time())
                self.detected.append(None)
                self.cluster.remove_node(victim, allow_graceful=not self.hard)
                watching = victim.node_id
                print(f"  +{now - t0:6.1f} s  removed a node{' (SIGKILL)' if self.hard else ''}", flush=True)
                due_remove, due_add = now + self.every, now + self.down
            if due_add is not None and now >= due_add:
                self.nodes.append(self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1"))
                self.adds.append(time.time())
                print(f"  +{now - t0:6.1f} s  added a node", flush=True)
                due_add = None
            time.sleep(0.05)


def _wait_first(steps: Path, timeout: float = 600.0) -> float:
    end = time.time() + timeout
    while time.time() < end:
        lines = _lines(steps)
        if len(lines) >= 3:
            return lines[2]["t"]
        time.sleep(0.1)
    raise RuntimeError(f"the job trained no 3 steps within {timeout:g} s")


def _lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text.splitlines(keepends=True) if x.endswith("\n")]


def one_ftrt(args, work: Path) -> dict:
    from ftrt.integrations.ray import ElasticGroup, loopback_cluster
    import ray

    steps = work / "steps.jsonl"
    cluster = loopback_cluster(args.nodes)
    stop = threading.Event()
    try:
        group = ElasticGroup("ftrt.examples.ray_regression:Regression", min_nodes=1, max_nodes=args.nodes,
                             kwargs={"step_time": args.step_time})

        def train() -> None:
            step = 0
            with open(steps, "a") as f:
                while not stop.is_set():
                    res = group.call("train", step, _batch(step))
                    f.write(json.dumps({"step": step, "t": time.time(), "world": res.world_size}) + "\n")
                    f.flush()
                    step += 1

        t = threading.Thread(target=train, daemon=True)
        t.start()
        t0 = _wait_first(steps)
        sched = Schedule(cluster, args.every, args.down, args.hard)
        sched.run(t0, args.duration, stop)
        stop.set()
        t.join(60)
        group.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"t0": t0, "faults": sched.faults, "ray_detected_s": sched.detected, "adds": sched.adds,
            "steps": _lines(steps)}


def _raytrain_loop(config: dict) -> None:
    """Ray Train's side: the very worker ftrt's group runs (its ``train`` reads the rank and world
    size from Ray Train's process group), checkpointed every ``ckpt_every`` steps."""
    import torch
    import ray.train
    from ray.train import Checkpoint

    from ftrt.examples.ray_regression import Regression

    worker = Regression(step_time=config["step_time"])
    rank = ray.train.get_context().get_world_rank()
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        worker.model.load_state_dict(state["model"])
        worker.step = int(state["step"])
    while True:
        step = worker.step + 1
        done = worker.train(step, _batch(step))
        if rank == 0:
            with open(config["steps"], "a") as f:
                f.write(json.dumps({"step": step, "t": time.time(), "world": done["world"]}) + "\n")
        if (step + 1) % config["ckpt_every"] == 0:
            if rank == 0:
                d = tempfile.mkdtemp()
                torch.save({"model": worker.model.state_dict(), "step": step}, os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
            else:
                ray.train.report({"step": step})


def one_raytrain(args, work: Path) -> dict:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"
    from ftrt.integrations.ray import loopback_cluster
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    steps = work / "steps.jsonl"
    cluster = loopback_cluster(args.nodes)
    stop = threading.Event()
    try:
        trainer = TorchTrainer(
            _raytrain_loop,
            train_loop_config={"step_time": args.step_time, "steps": str(steps), "ckpt_every": args.ckpt_every},
            scaling_config=ScalingConfig(num_workers=(1, args.nodes), use_gpu=False,
                                         elastic_resize_monitor_interval_s=5.0),
            run_config=RunConfig(name="bench", storage_path=str(work / "storage"),
                                 failure_config=FailureConfig(max_failures=-1),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)))
        t = threading.Thread(target=lambda: _quietly(trainer.fit), daemon=True)
        t.start()
        t0 = _wait_first(steps)
        sched = Schedule(cluster, args.every, args.down, args.hard)
        sched.run(t0, args.duration, stop)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"t0": t0, "faults": sched.faults, "ray_detected_s": sched.detected, "adds": sched.adds,
            "steps": _lines(steps)}


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the run is cut off at the window's end
        pass


def summarize(system: str, run: dict, duration: float) -> dict:
    t0, lines = run["t0"], run["steps"]
    end = t0 + duration
    window = [x for x in lines if t0 <= x["t"] <= end]
    before = [x for x in lines if x["t"] < t0]
    first_fault = run["faults"][0] if run["faults"] else end
    clean = [x["t"] for x in lines if x["t"] < first_fault]
    interval = statistics.median(b - a for a, b in zip(clean, clean[1:])) if len(clean) > 2 else float("nan")
    progress = max((x["step"] for x in window), default=0) - max((x["step"] for x in before), default=0)
    ends = [x["t"] for x in lines]
    faults, adds = run["faults"], run["adds"]
    after_loss, after_return = [], []
    for i, f in enumerate(faults):
        nxt = min(faults[i + 1] if i + 1 < len(faults) else end, end)
        back = next((a for a in adds if f < a < nxt), None)
        after_loss.append(round(_longest_gap(ends, f, back or nxt), 3))
        if back is not None:
            after_return.append(round(_longest_gap(ends, back, nxt), 3))
    return {"system": system, "progress_steps": progress, "steps_logged": len(window),
            "fault_free_step_s": round(interval, 4), "goodput": round(progress * interval / duration, 3),
            "stall_after_loss_s": after_loss, "stall_after_return_s": after_return,
            "ray_detected_s": run.get("ray_detected_s", []), "worlds": sorted({x["world"] for x in window})}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench ray", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {','.join(SYSTEMS)}")
    p.add_argument("--nodes", type=int, default=3, help="Ray worker nodes (raylets), one worker each")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of the measured window")
    p.add_argument("--every", type=float, default=60.0, help="a node removed every this many seconds")
    p.add_argument("--down", type=float, default=20.0, help="seconds until the removed node is added back")
    p.add_argument("--step-time", type=float, default=0.1, help="stand-in compute per step (s)")
    p.add_argument("--ckpt-every", type=int, default=10, help="Ray Train: a checkpoint every this many steps")
    p.add_argument("--hard", action="store_true", help="SIGKILL the removed node's processes (default: Ray's "
                   "graceful removal)")
    p.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--raw", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="result JSON (default bench/results/ray-<time>.json)")
    args = p.parse_args(argv)
    if args.one:  # a child: one system's run, in a fresh process
        work = Path(tempfile.mkdtemp(prefix=f"bench-ray-{args.one}-"))
        run = (one_ftrt if args.one == "ftrt" else one_raytrain)(args, work)
        Path(args.raw).write_text(json.dumps(run))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    t0 = time.time()
    rows = []
    for system in systems:
        raw = Path(tempfile.mkstemp(suffix=".json")[1])
        child = ["--nodes", str(args.nodes), "--duration", str(args.duration), "--every", str(args.every),
                 "--down", str(args.down), "--step-time", str(args.step_time), "--ckpt-every", str(args.ckpt_every),
                 *(["--hard"] if args.hard else [])]
        print(f"{system}: {args.duration:g} s window, a node removed every {args.every:g} s, "
              f"back {args.down:g} s later", flush=True)
        subprocess.run([sys.executable, "-m", "bench.ray_elastic", *child, "--one", system, "--raw", str(raw)],
                       check=True)
        row = summarize(system, json.loads(raw.read_text()), args.duration)
        print(json.dumps(row), flush=True)
        rows.append(row)
    res = {"rows": rows, "settings": vars(args)}
    by = {r["system"]: r for r in rows}
    if {"ftrt", "raytrain"} <= set(by) and by["raytrain"]["progress_steps"]:
        res["progress_ratio"] = round(by["ftrt"]["progress_steps"] / by["raytrain"]["progress_steps"], 2)
        print(f"steps of progress in the same window: ftrt {by['ftrt']['progress_steps']}, Ray Train "
              f"{by['raytrain']['progress_steps']}: {res['progress_ratio']}x", flush=True)
    path = save_result("ray", res, argv, t0, args.out)
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
