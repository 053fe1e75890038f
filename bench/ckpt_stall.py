"""Checkpoint stall benchmark: how much a checkpoint adds to the training step that takes it.

2 ranks (``ftrt launch --standalone --nproc-per-node 2``), 1 GiB of DTensor state in total
(``Shard(0)``, fp32), steps of ~0.19 s that first read the whole state (a reduction over every
tensor, padded with sleep to 0.19 s) and then update it in place (``add_(1)``). Every 5th step
checkpoints, in one of these modes, all in the same run:

- ``dcp_default``: ``dcp.async_save(state)`` (staging is synchronous inside the call);
- ``dcp_stager``: ``dcp.async_save(..., async_stager=DefaultStager(async staging, no pinned or
  shared memory))``; the update waits for ``staging_completion``;
- ``ftrt``: ``Checkpointer.save(step, state)`` before the read, ``handle.wait_staged()`` before
  the update.

Stall = median checkpoint-step time minus median plain-step time. After the run each mode's last
checkpoint is loaded and compared with the values the state had before that step's update.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("dcp_default", "dcp_stager", "ftrt")


def worker(out: str, gib: float, steps: int, every: int, step_s: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ftrt.checkpoint import Checkpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n_tensors = 8
    rows = int(gib * (1 << 30) / 4 / 4096 / n_tensors)
    state = {f"w{i}": distribute_tensor(torch.zeros(rows, 4096), mesh, [Shard(0)]) for i in range(n_tensors)}
    pg = dist.new_group(backend="gloo")
    work = Path(out).parent
    results: dict = {}

    def read_phase(t0: float) -> None:
        total = sum(t.to_local().sum().item() for t in state.values())  # reads every byte
        left = step_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return total

    def update() -> None:
        with torch.no_grad():
            for t in state.values():
                t.to_local().add_(1.0)

    for mode in MODES:
        for t in state.values():
            t.to_local().zero_()
        plain, ckpt = [], []
        ck = Checkpointer(str(work / "ftrt"), keep=2) if mode == "ftrt" else None
        pending = None
        last_step = -1
        dist.barrier()
        for step in range(steps):
            take = step % every == every - 1
            t0 = time.perf_counter()
            handle = None
            if take:
                if pending is not None:  # one save in flight at a time, like the Checkpointer
                    pending.result() if hasattr(pending, "result") else pending.upload_completion.result()
                if mode == "dcp_default":
                    pending = dcp.async_save(state, checkpoint_id=str(work / f"dcp-default-{step}"), process_group=pg)
                elif mode == "dcp_stager":
                    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                    stager = DefaultStager(StagingOptions(False, False, True, False))
                    pending = dcp.async_save(state, checkpoint_id=str(work / f"dcp-stager-{step}"),
                                             process_group=pg, async_stager=stager)
                else:
                    ts = time.perf_counter()
                    handle = ck.save(step, state)
                    t_save = time.perf_counter() - ts
                last_step = step
            read_phase(t0)
            if take and mode == "dcp_stager":
                pending.staging_completion.result()
            if handle is not None:
                tw = time.perf_counter()
                handle.wait_staged()
                if os.environ.get("FTRT_BENCH_DEBUG") and rank == 0:
                    print(f"step {step}: save() {t_save:.3f}s read {tw - t0 - t_save:.3f}s "
                          f"wait_staged {time.perf_counter() - tw:.3f}s stage {handle.stage_s:.3f}s", flush=True)
            update()
            dist.barrier()  # steps are synchronous across ranks, as with a gradient all-reduce
            (ckpt if take else plain).append(time.perf_counter() - t0)
        if pending is not None:
            pending.result() if hasattr(pending, "result") else pending.upload_completion.result()
        # The checkpoint of last_step must hold the values from before that step's update.
        expect = float(last_step)
        probe = {k: distribute_tensor(torch.full((rows, 4096), -1.0), mesh, [Shard(0)]) for k in state}
        if mode == "ftrt":
            ck.wait_pending()
            got = ck.restore(probe)
            assert got == last_step, (got, last_step)
            ck.close()
        else:
            name = "dcp-default" if mode == "dcp_default" else "dcp-stager"
            dcp.load(probe, checkpoint_id=str(work / f"{name}-{last_step}"), process_group=pg)
        exact = all(bool((t.to_local() == expect).all()) for t in probe.values())
        results[mode] = {
            "plain_step_s": statistics.median(plain), "ckpt_step_s": statistics.median(ckpt),
            "stall_s": statistics.median(ckpt) - statistics.median(plain), "checkpoints": len(ckpt),
            "stall_mean_s": statistics.mean(ckpt) - statistics.median(plain),
            "stall_max_s": max(ckpt) - statistics.median(plain),
            "restored_pre_update_state": exact,
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench ckpt_stall", description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="total state size (default 1 GiB)")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--every", type=int, default=15,
                   help="steps between checkpoints (default 15: ~4.5 s, which this VM's disk keeps up with)")
    p.add_argument("--step-time", type=float, default=0.19)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.out, args.gib, args.steps, args.every, args.step_time)
        return 0
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "0", str(Path(__file__)), "--worker", "--out", str(out),
               "--gib", str(args.gib), "--steps", str(args.steps), "--every", str(args.every),
               "--step-time", str(args.step_time)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout[-3000:], res.stderr[-3000:])
            return 1
        data = json.loads(out.read_text())
    base = data["dcp_default"]["stall_s"]
    print(f"{'mode':<14}{'plain step':>12}{'ckpt step':>12}{'stall':>10}{'mean':>8}{'max':>8}"
          f"{'vs dcp default':>16}{'exact':>8}")
    for mode in MODES:
        r = data[mode]
        ratio = r["stall_s"] / base if base > 0 else float("nan")
        print(f"{mode:<14}{r['plain_step_s']:>11.3f}s{r['ckpt_step_s']:>11.3f}s{r['stall_s']:>9.3f}s"
              f"{r['stall_mean_s']:>7.2f}s{r['stall_max_s']:>7.2f}s{ratio:>15.2f}x{str(r['restored_pre_update_state']):>8}")
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": "python -m bench ckpt_stall " + " ".join(argv),
              "gib": args.gib, "results": data}
    dest = ROOT / "bench" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"ckpt-stall-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
