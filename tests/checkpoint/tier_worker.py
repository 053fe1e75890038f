"""Worker for the memory-tier test under ``ftrt launch``.

State: one DTensor (``Shard(0)`` over the world) that holds ``arange(N) + s`` after step ``s``.
Every step takes a memory checkpoint (``persist=False``); every 25th also goes to storage.
At the start of each round the worker restores and checks the values; rank 0 logs JSON lines.
Arguments: URL LOG STEPS [HOLD]. While the file HOLD exists, every rank waits between two steps, so a
test can kill a node at rest: each rank's newest memory checkpoint saved and replicated.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ftrt

N = 1 << 16


def main():
    url, log_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hold = sys.argv[4] if len(sys.argv) > 4 else None
    rt = ftrt.init()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = distribute_tensor(torch.zeros(N), mesh, [Shard(0)])
    state = {"w": w, "meta": {"step": 0}}
    ck = rt.checkpointer(url, keep=2)
    t0 = time.monotonic()
    got = ck.restore(state)
    restore_s = time.monotonic() - t0
    step = state["meta"]["step"]
    ok = bool(torch.equal(w.full_tensor(), torch.arange(N, dtype=torch.float32) + step)) if got else True
    if got is None:
        with torch.no_grad():
            w.to_local().copy_(torch.arange(N, dtype=torch.float32)[w.to_local().shape[0] * dist.get_rank():][: w.to_local().shape[0]])
    if dist.get_rank() == 0:
        with open(log_path, "a") as f:
            f.write(json.dumps({"event": "restore", "round": rt.round, "world": dist.get_world_size(),
                                "step": got, "tier": ck.last_restore_tier, "ok": ok,
                                "restore_s": restore_s, "time": time.time()}) + "\n")
    while step < steps:
        step += 1
        with torch.no_grad():
            w.to_local().add_(1.0)
        state["meta"]["step"] = step
        h = ck.save(step, state, persist=(step % 25 == 0))
        h.wait_staged()
        rt.heartbeat(step)
        if dist.get_rank() == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps({"event": "step", "round": rt.round, "world": dist.get_world_size(),
                                    "step": step, "time": time.time()}) + "\n")
        dist.barrier()
        time.sleep(0.05)
        while hold and os.path.exists(hold):
            time.sleep(0.01)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
