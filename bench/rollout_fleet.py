"""The rollout fleet, side by side in one run: what a fault costs, what a push costs, what a step costs.

Everything runs here: one etcd, ``ftrt rollout serve`` processes, one-process GRPO trainers
(``python -m ftrt.grpo``, world size 1) on the job's default-sized model (the tiny one of the
tests would make every figure noise).

1. **Per-group sampling**: the fleet samples each prompt group alone (a fixed forward shape, so a
   sample does not depend on what else a server samples); its tokens/s against sampling a rank's
   16 prompts in one batch, in this process.
2. **Weight push**: a ~25M-parameter fp32 policy (d_model 720, 4 layers) published to 2 servers
   (median of ``--pushes`` versions: from publish to the second server's acknowledgement), in GB/s
   beside what one loopback TCP stream carries here.
3. **Step time**: local sampling vs the fleet with K=0 and K=1 (2 servers), median step time
   and tokens/s of steps 5.. of the same job.
4. **A server killed mid-step**: a server is frozen at a moment it holds prompt groups (the
   trainer stops advancing), then SIGKILLed; from the kill to the end of the stalled step, against
   regenerating the lost groups alone (their count times the per-group time of normal steps).
5. **A hung server**: frozen while it holds groups, ``request_timeout`` 2 s; from the freeze to
   the end of the stalled step (target: at most request_timeout + 1 s).
6. **Exactness under a storm**: for K=0 and K=1, a fault-free fleet run and a run in which
   servers are killed, frozen and added every ~1.5 s; the metrics must be bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXACT = ("step", "reward_mean", "loss", "kl", "prompt_ids", "weight_version")


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def _wait(cond, timeout: float, what: str, interval: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(interval)
    raise RuntimeError(f"timed out waiting for {what}")


class Lab:
    """An etcd and the rollout servers of one job at a time."""

    def __init__(self, work: Path) -> None:
        from ftrt.store.etcd_server import EtcdServer

        self.work = work
        self.etcd = EtcdServer(name="bench-fleet", unsafe_no_fsync=True).start()
        self.jobs = 0

    def job(self, servers: int):
        from ftrt.chaos.faults.rollout import RolloutServers

        self.jobs += 1
        job_id = f"fleet-{self.jobs}"
        fleet = RolloutServers(self.work, job_id, self.etcd.endpoint, job_id, "127.0.0.1", 2.0, [])
        for i in range(servers):
            fleet.start(f"rollout{i}")
        return job_id, fleet

    def trainer(self, job_id: str, config: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        metrics = self.work / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        log = open(self.work / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "ftrt.grpo", *config, f"metrics_path={metrics}",
                                 "progress=none", "checkpoint.url=null", f"rollout.etcd={self.etcd.endpoint}",
                                 f"rollout.job_id={job_id}"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return proc, metrics

    def close(self) -> None:
        self.etcd.stop()


def freeze_holding(fleet, name: str, metrics: Path, tries: int = 100) -> float:
    """SIGSTOP ``name`` at a moment it holds prompt groups: the trainer then makes no progress for
    four median steps (a freeze that catches it holding none, e.g. mid-push, is undone and tried
    again); the freeze time."""
    pid = fleet.procs[name].pid
    rows = _lines(metrics)[3:]
    quiet = max(0.5, 4 * statistics.median(r["step_s"] for r in rows)) if rows else 1.0
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        t = time.time()
        before = len(_lines(metrics))
        time.sleep(quiet)
        if len(_lines(metrics)) == before:
            return t
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05 + 0.1 * (hash(t) % 7) / 7)
    raise RuntimeError(f"{name} never held groups when frozen")


def per_group_sampling(repeats: int) -> dict:
    import torch

    from ftrt.grpo.config import GRPOConfig
    from ftrt.policy.sample import rollout, sample_group
    from ftrt.policy.setting import build_setting

    cfg = GRPOConfig()
    torch.set_num_threads(1)
    st = build_setting(cfg.model, cfg.task, seed=0, max_new_tokens=0)
    kw = dict(seed=0, group=cfg.group_size, max_new=st.max_new, temperature=cfg.temperature)
    batched, alone = [], []
    for r in range(repeats + 1):
        ids = list(range(r * 16, (r + 1) * 16))
        t0 = time.perf_counter()
        b = rollout(st.model, st.task, st.vocab, step=r, prompt_ids=ids, **kw)
        t1 = time.perf_counter()
        with torch.no_grad():
            for pid in ids:
                sample_group(st.model, st.task, st.vocab, step=r, prompt_id=pid, **kw)
        t2 = time.perf_counter()
        if r:
            tokens = float(b.mask.sum())
            batched.append(tokens / (t1 - t0))
            alone.append(tokens / (t2 - t1))
    out = {"batched_tok_s": statistics.median(batched), "per_group_tok_s": statistics.median(alone)}
    out["ratio"] = out["per_group_tok_s"] / out["batched_tok_s"]
    return out


def loopback_gbps(nbytes: int = 400 << 20) -> float:
    """One TCP stream over loopback, ``nbytes`` from one thread to another: GB/s."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                got[0] += len(chunk)

    th = threading.Thread(target=sink)
    th.start()
    buf = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(nbytes >> 20):
            c.sendall(buf)
    th.join()
    srv.close()
    return got[0] / (time.perf_counter() - t0) / 1e9


def weight_push(lab: Lab, pushes: int) -> dict:
    import torch

    from ftrt.grpo.config import load_config
    from ftrt.policy.model import param_count
    from ftrt.policy.setting import build_setting
    from ftrt.rollout.fleet import Fleet
    from ftrt.policy.spec import PolicySpec
    from ftrt.store.access import EtcdTarget
    from ftrt.store.sync import SyncStore

    cfg = load_config(None, ["model.d_model=720", "model.n_layers=4", "model.n_heads=8"])
    st = build_setting(cfg.model, cfg.task, seed=0, max_new_tokens=0)
    job_id, servers = lab.job(0)
    fleet = Fleet(store=SyncStore(EtcdTarget(lab.etcd.endpoint)), own_store=True, job_id=job_id, spec=PolicySpec.of(cfg),
                  vocab_size=len(st.vocab), max_new=st.max_new, request_timeout=30, wait_timeout=120,
                  push_timeout=60)
    try:
        for i in range(2):
            servers.start(f"rollout{i}")
        _wait(lambda: fleet.live == 2, 120, "2 servers")
        times, nbytes = [], 0
        for v in range(pushes + 1):
            with torch.no_grad():
                for p in st.model.parameters():
                    p.add_(1e-3)
            t0 = time.perf_counter()
            fleet.publish(v, st.model.state_dict(), keep_from=v)
            _wait(lambda: fleet.push_stats(v).servers == 2, 120, f"version {v} on 2 servers", 0.005)
            took = time.perf_counter() - t0
            nbytes = fleet.push_stats(v).bytes
            if v:  # the first push also opens the channels
                times.append(took)
    finally:
        fleet.close()
        servers.stop_all()
    med = statistics.median(times)
    return {"params": param_count(st.model), "bytes_to_2": nbytes, "median_s": med, "all_s": times,
            "gbps": nbytes / med / 1e9}


def step_times(lab: Lab, steps: int) -> dict:
    out = {}
    for mode, extra in (("local", []), ("fleet K=0", ["rollout.mode=fleet"]),
                        ("fleet K=1", ["rollout.mode=fleet", "rollout.max_off_policy_steps=1"])):
        job_id, servers = lab.job(2 if "fleet" in mode else 0)
        try:
            proc, metrics = lab.trainer(job_id, [f"steps={steps}", *extra], mode.replace(" ", "-").replace("=", ""))
            if proc.wait(900) != 0:
                raise RuntimeError(f"{mode} trainer failed; see {metrics.with_suffix('.log')}")
        finally:
            servers.stop_all()
        rows = _lines(metrics)[5:]
        out[mode] = {"step_s": statistics.median(r["step_s"] for r in rows),
                     "tok_s": statistics.median(r["tokens_per_s"] for r in rows),
                     "rollout_s": statistics.median(r.get("rollout_s", 0.0) for r in rows),
                     "push_s": statistics.median(r.get("push_s", 0.0) for r in rows)}
    return out


def kill_mid_step(lab: Lab, tries: int = 3) -> dict:
    """See the module docstring; a try whose stalled step re-sent no group (the freeze did not catch
    the server holding any after all) does not count, and is made again."""
    for _ in range(tries):
        got = _kill_once(lab)
        if got["lost_groups"]:
            return got
    raise RuntimeError(f"no kill caught the server holding groups in {tries} tries")


def _kill_once(lab: Lab) -> dict:
    job_id, servers = lab.job(2)
    try:
        proc, metrics = lab.trainer(job_id, ["steps=120", "rollout.mode=fleet"], "kill")
        _wait(lambda: len(_lines(metrics)) >= 20, 300, "20 steps")
        freeze_holding(servers, "rollout0", metrics)
        servers.procs["rollout0"].kill()
        t_kill = time.time()
        before = len(_lines(metrics))
        _wait(lambda: len(_lines(metrics)) > before, 60, "the stalled step")
        if proc.wait(600) != 0:
            raise RuntimeError("trainer failed")
    finally:
        servers.stop_all()
    rows = _lines(metrics)
    hit = next(r for r in rows if r["time"] > t_kill)
    normal = [r for r in rows[5:] if r["redispatched"] == 0 and r["rollout_servers"] == 2]
    per_group = statistics.median(r["rollout_s"] for r in normal) * 2 / 32  # 2 servers, 32 groups a step
    lost = hit["redispatched"]
    return {"kill_to_step_end_s": hit["time"] - t_kill, "lost_groups": lost,
            "regenerate_alone_s": lost * per_group, "excess_s": hit["time"] - t_kill - lost * per_group,
            "resumes": rows[-1]["resumes"]}


def hang(lab: Lab, timeout: float) -> dict:
    job_id, servers = lab.job(2)
    try:
        proc, metrics = lab.trainer(job_id, ["steps=120", "rollout.mode=fleet", f"rollout.request_timeout={timeout}"],
                                    "hang")
        _wait(lambda: len(_lines(metrics)) >= 20, 300, "20 steps")
        t_freeze = freeze_holding(servers, "rollout1", metrics)
        before = len(_lines(metrics))
        _wait(lambda: len(_lines(metrics)) > before, 60, "the stalled step")
        os.kill(servers.procs["rollout1"].pid, signal.SIGCONT)
        if proc.wait(600) != 0:
            raise RuntimeError("trainer failed")
    finally:
        servers.stop_all()
    rows = _lines(metrics)
    hit = next(r for r in rows if r["time"] > t_freeze)
    return {"freeze_to_step_end_s": hit["time"] - t_freeze, "request_timeout_s": timeout,
            "redispatched": hit["redispatched"], "resumes": rows[-1]["resumes"]}


def storm(lab: Lab, k: int, steps: int) -> dict:
    import random

    config = [f"steps={steps}", "rollout.mode=fleet", f"rollout.max_off_policy_steps={k}",
              "rollout.request_timeout=2", "prompts_per_step=8", "group_size=8"]
    runs = {}
    faults = 0
    for name in ("clean", "storm"):
        job_id, servers = lab.job(3)
        try:
            proc, metrics = lab.trainer(job_id, config, f"storm-k{k}-{name}")
            _wait(lambda: len(_lines(metrics)) >= 3, 300, "3 steps")
            rng = random.Random(k)
            while name == "storm" and proc.poll() is None:
                time.sleep(rng.uniform(0.5, 2.5))
                alive = servers.alive()
                kind = rng.choice(["kill", "freeze", "add"]) if len(alive) > 1 else "add"
                if kind == "add" or not alive:
                    servers.start(servers.next_name())
                else:
                    victim = rng.choice(alive)
                    pid = servers.procs[victim].pid
                    if kind == "kill":
                        servers.procs[victim].kill()
                    else:
                        os.kill(pid, signal.SIGSTOP)
                        threading.Timer(3.0, lambda p=pid: _cont(p)).start()
                faults += 1
            if proc.wait(900) != 0:
                raise RuntimeError(f"storm K={k} {name} trainer failed")
        finally:
            servers.stop_all()
        runs[name] = _lines(metrics)
    same = [{f: r[f] for f in EXACT} for r in runs["clean"]] == [{f: r[f] for f in EXACT} for r in runs["storm"]]
    return {"k": k, "faults": faults, "identical": same, "steps": len(runs["storm"]),
            "redispatched": sum(r["redispatched"] for r in runs["storm"]), "resumes": runs["storm"][-1]["resumes"]}


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench rollout_fleet", description=__doc__.splitlines()[0])
    p.add_argument("--pushes", type=int, default=5, help="weight versions pushed (default 5)")
    p.add_argument("--steps", type=int, default=40, help="steps per step-time run (default 40)")
    p.add_argument("--storm-steps", type=int, default=150, help="steps per storm run (default 150)")
    p.add_argument("--request-timeout", type=float, default=2.0)
    p.add_argument("--only", default="sampling,push,steps,kill,hang,storm", help="comma-separated parts")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    parts = set(args.only.split(","))
    work = ROOT / "bench" / "results" / "rollout-fleet-work"
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"cores": os.cpu_count()}
    lab = Lab(work)
    try:
        if "sampling" in parts:
            res["sampling"] = s = per_group_sampling(10)
            print(f"sampling: per group {s['per_group_tok_s']:,.0f} tok/s vs one batch of 16 prompts "
                  f"{s['batched_tok_s']:,.0f} tok/s ({s['ratio']:.2f}x)", flush=True)
        if "push" in parts:
            res["loopback_gbps"] = loopback_gbps()
            res["push"] = w = weight_push(lab, args.pushes)
            print(f"push: {w['params'] / 1e6:.1f}M params to 2 servers: median {w['median_s']:.3f} s "
                  f"({w['gbps']:.2f} GB/s; one loopback TCP stream {res['loopback_gbps']:.2f} GB/s); target <= 2 s",
                  flush=True)
        if "steps" in parts:
            res["steps"] = st = step_times(lab, args.steps)
            base = st["local"]["step_s"]
            for mode, v in st.items():
                print(f"steps: {mode:<10} median step {v['step_s']:.3f} s ({v['step_s'] / base:.2f}x local), "
                      f"{v['tok_s']:,.0f} tok/s, waiting for rollouts {v['rollout_s']:.3f} s", flush=True)
        if "kill" in parts:
            res["kill"] = kl = kill_mid_step(lab)
            print(f"kill: kill -> end of the stalled step {kl['kill_to_step_end_s']:.3f} s; regenerating its "
                  f"{kl['lost_groups']} lost groups alone {kl['regenerate_alone_s']:.3f} s; excess "
                  f"{kl['excess_s']:.3f} s (target <= 1 s); trainer resumes {kl['resumes']}", flush=True)
        if "hang" in parts:
            res["hang"] = hg = hang(lab, args.request_timeout)
            print(f"hang: freeze -> end of the stalled step {hg['freeze_to_step_end_s']:.3f} s "
                  f"(request_timeout {hg['request_timeout_s']:g} s; target <= {hg['request_timeout_s'] + 1:g} s); "
                  f"trainer resumes {hg['resumes']}", flush=True)
        if "storm" in parts:
            res["storm"] = []
            for k in (0, 1):
                sm = storm(lab, k, args.storm_steps)
                res["storm"].append(sm)
                print(f"storm K={k}: {sm['faults']} rollout faults, {sm['redispatched']} groups sent again, "
                      f"trainer resumes {sm['resumes']}: metrics {'bit-identical' if sm['identical'] else 'DIFFER'} "
                      "to the fault-free fleet run", flush=True)
    finally:
        lab.close()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    ok = all(s["identical"] for s in res.get("storm", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
