"""Worker for multi-rank checkpoint tests, run under ``ftrt launch --standalone``.

Scenarios (argv[1]): ``save`` (FSDP2 train 2 steps, save step 2, write the full reference state),
``restore`` (fresh FSDP2 model at this world size, restore, compare with the reference),
``concurrent`` (training all-reduces on the default group while a large save persists), ``late``
(one rank reaches a ``skip_if_busy`` save half a second after the other).
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ftrt
from ftrt.checkpoint import Checkpointer


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 7))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(model):
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items()}


def main():
    scenario, url, ref, out = sys.argv[1:5]
    rt = ftrt.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario == "save":
        model, opt = build(0)
        for _ in range(2):
            torch.manual_seed(100 + rank)
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        ck = Checkpointer(url)
        ck.save(2, {"model": model, "optim": opt, "meta": {"world": dist.get_world_size()}}).wait()
        ck.close()
        sd = full(model)
        if rank == 0:
            torch.save(sd, ref)
    elif scenario == "restore":
        model, opt = build(1)
        state = {"model": model, "optim": opt, "meta": {"world": 0}}
        ck = Checkpointer(url)
        step = ck.restore(state)
        ck.close()
        sd = full(model)  # the full state lands on rank 0 only (cpu_offload)
        want = torch.load(ref)
        same = rank != 0 or (set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want))
        # The optimizer must be usable after a resharded restore.
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"step": step, "same": same, "saved_world": state["meta"]["world"],
                           "world": dist.get_world_size()}, f)
    elif scenario == "concurrent":
        big = {"w": torch.randn(2048, 2048), "v": torch.randn(4096, 1024)}
        ck = Checkpointer(url)
        h = ck.save(1, big)
        h.wait_staged()
        # Every rank runs the same number of all-reduces (a count that depends on local timing
        # would itself deadlock); we count how many overlapped the background save.
        results, overlapped = [], 0
        for _ in range(300):
            t = torch.ones(1000)
            dist.all_reduce(t)
            results.append(t[0].item())
            overlapped += not h.done()
        h.wait()
        ck.close()
        ok = all(r == dist.get_world_size() for r in results)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"all_reduces": len(results), "overlapped": overlapped, "ok": ok}, f)
    elif scenario == "late":
        # Rank 1 reaches the save 0.5 s after rank 0: rank 0 waits that long in the skip vote.
        ck = Checkpointer(url)
        state = {"w": torch.randn(64, 64)}
        if rank == 1:
            time.sleep(0.5)
        h = ck.save(1, state, skip_if_busy=True)
        h.wait()
        ck.close()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"blocked_s": h.blocked_s, "vote_wait_s": h.vote_wait_s, "cost_s": h.cost_s}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
