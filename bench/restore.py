"""Restore benchmark: after a node loss, restore from peer memory vs ``dcp.load`` from disk and S3.

Two nodes (one ``ftrt launch`` agent and one worker each, on an etcd this benchmark starts) hold
1 GiB of DTensor state in total (``Shard(0)`` over 2 ranks, 8 fp32 tensors). The job checkpoints
once through ``ftrt.init().checkpointer(dir)`` (memory tier and local disk) and once more to S3
(moto's server on loopback) with a plain :class:`~ftrt.checkpoint.Checkpointer`; rank 0 waits
until its agent holds the replica of rank 1's memory checkpoint. Then node 1 is SIGKILLed (agent
and worker). The survivor's worker starts again at world size 1 and, in that one process, times:

- ``ftrt_memory``: ``Checkpointer.restore`` right after the loss (its own node's arena plus the
  lost node's replica, resharded 2 -> 1), then twice more;
- ``dcp_local``: ``dcp.load`` of the same checkpoint folder from local disk (page cache warm:
  the baseline's best case), twice;
- ``dcp_s3``: ``dcp.load`` of the same checkpoint from S3 (fsspec reader), once;
- ``ftrt_storage``: ``Checkpointer.restore`` without the memory tier (checksums verified, then
  loaded from disk).

The baselines run after the survivor's agent has warmed its replacement spares (which it does
once the restored workers heartbeat), so they get the machine to themselves.

Same state, same world sizes (saved at 2, loaded at 1) for every mode; every load is checked
value for value against the saved state.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N_TENSORS = 8
COLS = 4096


def _state(gib: float, value_of_rows: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    rows = int(gib * (1 << 30) / 4 / COLS / N_TENSORS)
    rows -= rows % 2  # divisible by both world sizes
    state = {}
    for i in range(N_TENSORS):
        t = distribute_tensor(torch.empty(rows, COLS), mesh, [Shard(0)])
        local = t.to_local()
        if value_of_rows:
            first = rank * local.shape[0]
            local.copy_(_expected(i, first, local.shape[0]).expand_as(local))
        else:
            local.fill_(-1.0)
        state[f"w{i}"] = t
    return state


def _expected(i: int, first_row: int, n: int):
    import torch

    return ((torch.arange(first_row, first_row + n, dtype=torch.float32) % 65536) + 1000 * i).unsqueeze(1)


def _check(state) -> bool:
    import torch.distributed as dist

    ok = True
    for i in range(N_TENSORS):
        local = state[f"w{i}"].to_local()
        first = dist.get_rank() * local.shape[0]
        ok &= bool((local == _expected(i, first, local.shape[0])).all())
    return ok


def _reset(state) -> None:
    for t in state.values():
        t.to_local().fill_(-1.0)


def worker(work: Path, s3_url: str, s3_opts: dict, gib: float) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    import ftrt
    from ftrt.checkpoint import Checkpointer
    from ftrt.checkpoint.memtier import scan
    from ftrt.checkpoint.storage import step_dir

    rt = ftrt.init()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ready = work / "ready.json"
    if world == 2:
        state = _state(gib, value_of_rows=True)
        ck = rt.checkpointer(str(work / "local"), keep=2)
        ck.save(1, state).wait()
        ck.close()
        s3 = Checkpointer(s3_url, keep=2, storage_options=s3_opts)
        s3.save(1, state).wait()
        s3.close()
        if rank == 0:  # the lost node's replica must be here before the fault
            deadline = time.monotonic() + 120
            mem = os.environ["FTRT_MEM_DIR"]
            while not any(x["rank"] == 1 and x["step"] == 1 and "/replicas/" in x["file"] for x in scan(mem)):
                if time.monotonic() > deadline:
                    raise SystemExit("rank 1's memory checkpoint never reached node 0")
                time.sleep(0.1)
            ready.write_text(json.dumps({"time": time.time()}))
        while True:  # train on (stand-in) until the node loss changes the round
            rt.heartbeat(1)
            time.sleep(0.2)
    if not ready.exists():  # a first round formed before both nodes were up: wait for the next one
        while True:
            rt.heartbeat(0)
            time.sleep(0.2)
    state = _state(gib, value_of_rows=False)
    out: dict = {"world": world}

    def timed(name: str, fn) -> None:
        _reset(state)
        t0 = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t0
        out.setdefault(name, {"times_s": [], "exact": True, "steps": []})
        out[name]["times_s"].append(dt)
        out[name]["exact"] &= _check(state)
        out[name]["steps"].append(got)
        print(f"[restore bench] {name}: {dt:.3f} s", flush=True)

    ck = rt.checkpointer(str(work / "local"), keep=2)
    for _ in range(3):
        timed("ftrt_memory", lambda: (ck.restore(state), ck.last_restore_tier))
    ck.close()
    # Training resumes (the agent then warms replacement spares); the baselines run once that is
    # over, so they do not share the CPU with it.
    go = work / "baselines.go"
    deadline = time.monotonic() + 90
    while not go.exists() and time.monotonic() < deadline:
        rt.heartbeat(2)
        time.sleep(0.1)
    folder = str(work / "local" / step_dir(1))
    for _ in range(2):
        timed("dcp_local", lambda: dcp.load(state, storage_reader=FileSystemReader(folder)))
    s3_folder = s3_url.rstrip("/") + "/" + step_dir(1)
    timed("dcp_s3", lambda: dcp.load(state, storage_reader=FsspecReader(s3_folder, **s3_opts)))
    plain = Checkpointer(str(work / "local"), keep=2)
    timed("ftrt_storage", lambda: (plain.restore(state), plain.last_restore_tier))
    plain.close()
    (work / "result.json").write_text(json.dumps(out, indent=2))
    dist.destroy_process_group()


def _warm_after(node, round_no: int) -> bool:
    """``node``'s agent runs a round after ``round_no`` (it took its spares for it) and has warmed
    new ones, by its own ``Status``."""
    st = node.agent_status()
    return st is not None and st.health.round > round_no and st.warm_workers >= node.agent.config.nproc_per_node


def run(gib: float, work: Path) -> dict:
    from ftrt.chaos.local import LocalNode, wait_until
    from ftrt.chaos.s3server import MotoS3
    from ftrt.store.etcd_server import EtcdServer

    with MotoS3() as s3, EtcdServer(name="bench-restore", unsafe_no_fsync=True,
                                     log_path=str(work / "etcd.log")) as etcd:
        s3.create_bucket("bench")
        opts = json.dumps(s3.storage_options())
        launch = ["--etcd", etcd.endpoint, "--job-id", "restore", "--nnodes", "1:2", "--lease-ttl", "2",
                  "--first-round-wait", "5", "--max-restarts", "3", str(Path(__file__)), "--worker",
                  "--work", str(work), "--s3-url", "s3://bench/run", "--s3-opts", opts, "--gib", str(gib)]
        env = {"PYTHONPATH": str(ROOT)}
        nodes = {n: LocalNode(work, n, launch, env=env).start() for n in ("node0", "node1")}
        try:
            wait_until(lambda: (work / "ready.json").exists(), 300, "both checkpoints and the replica")
            before = nodes["node0"].agent_status()
            if before is None:
                raise SystemExit(f"node0's agent does not answer Status; see {work}/agent-node0.log")
            nodes["node1"].kill()
            print("[restore bench] node1 SIGKILLed; the survivor restores at world size 1", flush=True)
            wait_until(lambda: _warm_after(nodes["node0"], before.health.round), 90,
                       "the survivor's spares to be warm again", interval=0.25)
            (work / "baselines.go").write_text("")
            code = nodes["node0"].wait(600)
            if code != 0 or not (work / "result.json").exists():
                raise SystemExit(f"the survivor failed (exit {code}); see {work}/agent-node0.log")
        finally:
            for n in nodes.values():
                n.cleanup()
    return json.loads((work / "result.json").read_text())


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench restore", description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="total state size (default 1 GiB)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--s3-url", help=argparse.SUPPRESS)
    p.add_argument("--s3-opts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(Path(args.work), args.s3_url, json.loads(args.s3_opts), args.gib)
        return 0
    logs = ROOT / "bench" / "results" / "logs" / f"restore-{time.strftime('%Y%m%d-%H%M%S')}"
    with tempfile.TemporaryDirectory(prefix="bench-restore-") as tmp:
        try:
            data = run(args.gib, Path(tmp))
        finally:
            logs.mkdir(parents=True, exist_ok=True)
            for f in Path(tmp).glob("*.log"):
                (logs / f.name).write_bytes(f.read_bytes())
    med = {k: statistics.median(v["times_s"]) for k, v in data.items() if isinstance(v, dict)}
    first_mem = data["ftrt_memory"]["times_s"][0]
    tiers = {s[1] for s in data["ftrt_memory"]["steps"]}
    print(f"\nrestore of {args.gib:g} GiB saved at world 2, loaded at world 1 after a node loss")
    print(f"{'mode':<14}{'median':>10}{'runs':>24}{'exact':>8}{'dcp_local/x':>13}{'dcp_s3/x':>10}")
    for k, v in data.items():
        if not isinstance(v, dict):
            continue
        runs = " ".join(f"{t:.2f}" for t in v["times_s"])
        print(f"{k:<14}{med[k]:>9.3f}s{runs:>24}{str(v['exact']):>8}"
              f"{med['dcp_local'] / med[k]:>12.1f}x{med['dcp_s3'] / med[k]:>9.1f}x")
    print(f"ftrt memory tier used: {sorted(tiers)}; first restore after the loss {first_mem:.3f} s: "
          f"{med['dcp_local'] / first_mem:.1f}x faster than dcp.load from disk, "
          f"{med['dcp_s3'] / first_mem:.1f}x than from S3")
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": "python -m bench restore " + " ".join(argv),
              "gib": args.gib, "results": data, "medians_s": med,
              "speedup_first_vs_dcp_local": med["dcp_local"] / first_mem,
              "speedup_first_vs_dcp_s3": med["dcp_s3"] / first_mem}
    dest = ROOT / "bench" / "results"
    path = dest / f"restore-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    ok = tiers == {"memory"} and all(v["exact"] for v in data.values() if isinstance(v, dict))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
