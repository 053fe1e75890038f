"""What one memory checkpoint costs: the goodput job's state saved to a memory tier, save after save.

One process, no launcher: a :class:`~ftrt.checkpoint.Checkpointer` with a memory tier on tmpfs
saves the GRPO policy of ``python -m bench goodput`` (model and AdamW state, 4.8 MB in 120
tensors at its default size) ``--saves`` times, ``persist=False``, waiting for each. Per save it
records the handle's ``cost_s`` (what the ``auto`` cadence plans with: the caller's blocked time
plus the staging thread's CPU), the wall time and the process's CPU time. The baseline, measured
in the same run on the same tensors: copying every tensor into preallocated buffers, the floor
any in-memory copy pays. The ratio is the save's cost over that floor.

``python -m bench memsave [--saves N] [--d-model D]``; the first ``--warmup`` saves (which
allocate the arena and take DCP's checked path once) are left out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench.goodput import GRPO, save_result


def _state(d_model: int):
    import torch

    from ftrt.grpo.config import load_config
    from ftrt.policy.setting import build_setting

    cfg = load_config(None, [f"model.d_model={d_model}", f"model.n_layers={GRPO['model.n_layers']}",
                             f"model.n_heads={GRPO['model.n_heads']}"])
    model = build_setting(cfg.model, cfg.task, seed=0, max_new_tokens=cfg.max_new_tokens).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # the optimizer's state exists, as in training
    return {"model": model, "optim": opt, "trainer": {"step": 0, "frontier": 0, "redone": 0, "resumes": 0}}


def run(saves: int, warmup: int, d_model: int) -> dict:
    """Median per-save numbers (milliseconds) of ``saves`` memory checkpoints and of the copy floor."""
    import torch

    from ftrt.checkpoint import Checkpointer

    torch.set_num_threads(1)
    state = _state(d_model)
    tensors = [t for t in state["model"].state_dict().values()]
    tensors += [v for s in state["optim"].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    rows: list[tuple[float, float, float]] = []
    floor: list[float] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as work:
        with Checkpointer(f"{work}/ck", mem_dir=f"{work}/mem") as ck:
            for i in range(warmup + saves):
                t0, c0 = time.perf_counter(), time.process_time()
                h = ck.save(i, state, persist=False)
                h.wait()
                if i >= warmup:
                    rows.append((h.cost_s, time.perf_counter() - t0, time.process_time() - c0))
                t0 = time.perf_counter()
                for b, t in zip(buffers, tensors):
                    b.copy_(t)
                if i >= warmup:
                    floor.append(time.perf_counter() - t0)
    med = {k: statistics.median(r[j] for r in rows) * 1000 for j, k in enumerate(("cost_ms", "wall_ms", "cpu_ms"))}
    copy_ms = statistics.median(floor) * 1000
    return {"tensors": len(tensors), "mb": round(nbytes / 1e6, 2), "saves": saves,
            **{k: round(v, 3) for k, v in med.items()}, "copy_floor_ms": round(copy_ms, 3),
            "cost_over_floor": round(med["cost_ms"] / copy_ms, 2) if copy_ms > 0 else None}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench memsave", description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=200, help="saves measured (default 200)")
    p.add_argument("--warmup", type=int, default=5, help="first saves left out (default 5)")
    p.add_argument("--d-model", type=int, default=GRPO["model.d_model"],
                   help=f"the policy's width (default {GRPO['model.d_model']}, the goodput job's)")
    p.add_argument("--out", default=None, help="JSON result path (default bench/results/memsave-<time>.json)")
    args = p.parse_args(argv)
    if args.saves < 1 or args.warmup < 0:
        p.error("--saves must be >= 1 and --warmup >= 0")
    t0 = time.time()
    res = run(args.saves, args.warmup, args.d_model)
    print(f"memory checkpoint of {res['mb']} MB in {res['tensors']} tensors, median of {res['saves']} saves: "
          f"cost {res['cost_ms']:.2f} ms (wall {res['wall_ms']:.2f} ms, process CPU {res['cpu_ms']:.2f} ms); "
          f"copying the same tensors {res['copy_floor_ms']:.2f} ms; cost over that floor {res['cost_over_floor']}x")
    print(f"wrote {save_result('memsave', {'rows': [res]}, argv, t0, args.out)}")
    return 0
