"""Rendezvous at scale: 16, 64 and 256 simulated nodes, ftrt on etcd beside torchrun's c10d.

ftrt: the nodes are :mod:`ftrt.agents.ops.sim` nodes (the agent's real lease, registration and
rendezvous code, each node on its own etcd client, stand-in workers), spread over a few
processes, against one local etcd. Every node is connected first; then all register at once.
Measured:

- ``join``: from the command to join to the moment the last node holds the round with all N
  members (``after_last_join``: the same, counted from the last node's registration);
- ``loss``: one node's lease is revoked (what a peer does when it finds a node dead; detection
  itself is measured by ``python -m bench recovery``); time until every survivor holds the round
  of N-1;
- ``decider loss``: the same for the node that decides rounds (another must take over first);
- etcd's own counters (its ``/metrics``) over each phase: client requests (unary RPCs and watch
  creations; lease keep-alives apart, they depend on time, not rounds) and watch events sent.

torchrun: N ``DynamicRendezvousHandler`` instances on the c10d backend (threads, spread over the
same number of processes), each with its own client of one TCPStore, as torchrun's agents share
the first node's store, with the settings ``python -m bench recovery`` gives torchrun at its best
(``last_call_timeout=1``, ``keep_alive_interval=1``, ``keep_alive_max_attempt=3``). ``join``: all
call ``next_rendezvous()`` at once, until the last returns. ``loss``: one stops its keep-alive
(a dead node), the others call ``next_rendezvous()`` again, as torchrun's agents do once their
workers fail (that detection is not counted), until the last returns. Sizes where a phase does not
finish within ``--cap`` seconds are reported as such.

Both run on the same 2 cores, with every simulated node's client work on them too: the numbers
are pessimistic for both, and compared side by side. Each ftrt phase also records the CPU seconds
of etcd and of the simulated nodes' processes (``cores_busy``: how much of the machine it used) and
etcd's bytes sent; ``--pin`` gives etcd a core of its own to show which side bounds a phase.
``FTRT_BENCH_ETCD_LOG=PATH`` keeps etcd's log.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_BEST = {"last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 3}
TORCHRUN_DEFAULT = {"last_call_timeout": 30, "keep_alive_interval": 5, "keep_alive_max_attempt": 3}


# -- etcd counters ---------------------------------------------------------------------------------
def etcd_counters(endpoint: str) -> dict[str, float]:
    """Client requests, keep-alives and watch events so far, from etcd's /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    out = {"requests": 0.0, "keepalives": 0.0, "watch_events": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("grpc_server_handled_total{") and 'grpc_type="unary"' in name \
                and "etcdserverpb." in name:
            out["requests"] += float(value)
        elif name.startswith("grpc_server_msg_received_total{"):
            if 'grpc_method="LeaseKeepAlive"' in name:
                out["keepalives"] += float(value)
            elif 'grpc_method="Watch"' in name and "etcdserverpb.Watch" in name:
                out["requests"] += float(value)  # watch create/cancel requests on the streams
        elif name == "etcd_debugging_mvcc_events_total":
            out["watch_events"] += float(value)
        elif name == "etcd_network_client_grpc_sent_bytes_total":
            out["bytes_sent"] += float(value)
        elif name == "etcd_network_client_grpc_received_bytes_total":
            out["bytes_received"] += float(value)
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(stat[11]) + int(stat[12])
    return total / tick


def pin_process(pid: int, cores: list[int]) -> None:
    """Restrict every thread of ``pid`` to ``cores`` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:
            continue  # a thread that ended meanwhile


class CpuMeter:
    """CPU seconds of the simulated nodes' processes and of etcd over one phase, beside its wall
    time: how close the phase came to using every core of the machine."""

    def __init__(self, sims: list[int], etcd: int | None) -> None:
        self.sims, self.etcd = sims, [etcd] if etcd else []
        self.t0, self.s0, self.e0 = time.monotonic(), cpu_seconds(self.sims), cpu_seconds(self.etcd)

    def read(self) -> dict:
        wall = time.monotonic() - self.t0
        sim, etcd = cpu_seconds(self.sims) - self.s0, cpu_seconds(self.etcd) - self.e0
        return {"wall_s": round(wall, 3), "sims_cpu_s": round(sim, 2), "etcd_cpu_s": round(etcd, 2),
                "cores_busy": round((sim + etcd) / wall, 2) if wall else None}


def _delta(a: dict, b: dict) -> dict:
    return {k: int(round(b[k] - a[k])) for k in a}


# -- processes speaking JSON lines -------------------------------------------------------------------
class Proc:
    """A child process: commands on stdin, JSON events on stdout (read by a thread into a queue)."""

    def __init__(self, argv: list[str], events: "queue.Queue[dict]") -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.t = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.t.start()

    def _read(self, events) -> None:
        for line in self.p.stdout:
            try:
                events.put(json.loads(line))
            except ValueError:
                continue

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        try:
            self.send("quit")
            self.p.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


def _collect(events: "queue.Queue[dict]", done, cap: float) -> list[dict]:
    """Events until ``done(events so far)`` is true or ``cap`` seconds pass."""
    got: list[dict] = []
    deadline = time.monotonic() + cap
    while not done(got):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            got.append(events.get(timeout=min(left, 0.5)))
        except queue.Empty:
            continue
    return got


def _slices(n: int, procs: int) -> list[tuple[int, int]]:
    per = -(-n // procs)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


# -- ftrt --------------------------------------------------------------------------------------------
def run_ftrt(n: int, procs: int, endpoint: str, cap: float, lease_ttl: float = 5.0, etcd_pid: int | None = None,
             pin: bool = False) -> dict:
    job = f"scale{n}-{int(time.time() * 1000) % 10 ** 8}"
    events: queue.Queue = queue.Queue()
    slices = _slices(n, procs)
    ps = [Proc([sys.executable, "-m", "ftrt.agents.ops.sim", "--etcd", endpoint, "--job-id", job, "--nodes", f"{lo}:{hi}",
                "--max-nodes", str(n), "--lease-ttl", str(lease_ttl)], events) for lo, hi in slices]
    if pin:  # etcd keeps the first core to itself (see main); the simulated nodes share the rest
        for p in ps:
            pin_process(p.p.pid, sorted(os.sched_getaffinity(0))[1:])
    try:
        ready = _collect(events, lambda g: sum(e["event"] == "connected" for e in g) == len(ps), 120)
        if sum(e["event"] == "connected" for e in ready) < len(ps):
            raise RuntimeError("simulated nodes did not connect within 120 s")
        c0 = etcd_counters(endpoint)
        cpu = CpuMeter([p.p.pid for p in ps], etcd_pid)
        t0 = time.time()
        for p in ps:
            p.send("join")
        got = _collect(events, lambda g: sum(e["event"] == "round" and e["world"] == n for e in g) >= n, cap)
        join_cpu = cpu.read()
        c1 = etcd_counters(endpoint)
        agreed = [e["t"] for e in got if e["event"] == "round" and e["world"] == n]
        registered = [e["t"] for e in got if e["event"] == "registered"]
        ranks = sorted(r for e in got if e["event"] == "round" and e["world"] == n for r in e["ranks"])
        out = {"system": "ftrt", "nodes": n, "procs": len(ps), "lease_ttl": lease_ttl, "pinned": pin, "notes": []}
        if len(agreed) < n:
            out["join_s"] = None
            out["notes"].append(f"join: only {len(agreed)} of {n} nodes held the round within {cap:.0f} s")
            return out
        assert ranks == list(range(n)), "every rank must be given exactly once"
        out.update(join_s=round(max(agreed) - t0, 3), after_last_join_s=round(max(agreed) - max(registered), 3),
                   registered_s=round(max(registered) - t0, 3), first_held_s=round(min(agreed) - t0, 3),
                   join_etcd=_delta(c0, c1), join_cpu=join_cpu)
        time.sleep(1.0)  # a quiet second between the phases
        victim = n // 2
        owner = next(i for i, (lo, hi) in enumerate(slices) if lo <= victim < hi)
        c2 = etcd_counters(endpoint)
        cpu = CpuMeter([p.p.pid for p in ps], etcd_pid)
        ps[owner].send(f"kill sim{victim}")
        got = _collect(events, lambda g: sum(e["event"] == "round" and e["world"] == n - 1 for e in g) >= n - 1, cap)
        loss_cpu = cpu.read()
        c3 = etcd_counters(endpoint)
        killed = [e["t"] for e in got if e["event"] == "killed"]
        after = [e["t"] for e in got if e["event"] == "round" and e["world"] == n - 1]
        if not killed or len(after) < n - 1:
            out["loss_s"] = None
            out["notes"].append(f"loss: only {len(after)} of {n - 1} survivors held the new round within {cap:.0f} s")
        else:
            out.update(loss_s=round(max(after) - killed[0], 3), loss_first_held_s=round(min(after) - killed[0], 3),
                       loss_etcd=_delta(c2, c3), loss_cpu=loss_cpu)
        time.sleep(1.0)
        for p in ps:
            p.send("kill-decider")
        got = _collect(events, lambda g: sum(e["event"] == "round" and e["world"] == n - 2 for e in g) >= n - 2, cap)
        killed = [e for e in got if e["event"] == "killed"]
        after = [e["t"] for e in got if e["event"] == "round" and e["world"] == n - 2]
        if not killed:
            out["decider_loss_s"] = None
            out["notes"].append("decider loss: no simulated node was deciding when the decider was to be killed")
        elif len(after) < n - 2:
            out["decider_loss_s"] = None
            out["notes"].append(f"decider loss: only {len(after)} of {n - 2} survivors held the round within "
                                f"{cap:.0f} s")
        else:
            out.update(decider_loss_s=round(max(after) - killed[0]["t"], 3), decider=killed[0]["node"])
        return out
    finally:
        for p in ps:
            p.close()


# -- torchrun's c10d rendezvous ---------------------------------------------------------------------
def c10d_child(argv: list[str]) -> int:
    """In a child process: ``count`` handlers in threads; commands ``join``, ``kill I``, ``rejoin``."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    host, port, run_id, lo, hi, n = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4]), int(argv[5])
    knobs = json.loads(argv[6])
    lock = threading.Lock()

    def emit(event: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    handlers = {}
    for i in range(lo, hi):
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300))
        backend = C10dRendezvousBackend(store, run_id)
        handlers[i] = DynamicRendezvousHandler.from_backend(
            run_id, store, backend, 1, n, local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=timedelta(seconds=600), last_call=timedelta(seconds=knobs["last_call_timeout"]),
                                      close=timedelta(seconds=30), heartbeat=timedelta(seconds=5)),
            keep_alive_interval=knobs["keep_alive_interval"],
            keep_alive_max_attempt=knobs["keep_alive_max_attempt"])
    emit({"event": "connected", "nodes": len(handlers), "t": time.time()})
    dead: set[int] = set()

    def join(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
            emit({"event": "round", "node": i, "world": info.world_size, "rank": info.rank, "t": time.time()})
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which records it
            emit({"event": "error", "node": i, "error": f"{type(exc).__name__}: {exc}", "t": time.time()})

    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit" or not cmd:
            break
        if cmd in ("join", "rejoin"):
            for i in handlers:
                if i not in dead:
                    threading.Thread(target=join, args=(i,), daemon=True).start()
        elif cmd == "kill":
            i = int(arg)
            handlers[i]._stop_heartbeats()  # a dead node's keep-alive stops; nothing else is said
            dead.add(i)
            emit({"event": "killed", "node": i, "t": time.time()})
    os._exit(0)  # handler threads may be blocked in the store; the bench is done with them


def run_torchrun(n: int, procs: int, cap: float, knobs: dict | None = None) -> dict:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    run_id = f"scale{n}"
    events: queue.Queue = queue.Queue()
    slices = _slices(n, procs)
    # as in bench.recovery: torchrun's shared TCPStore is off (pytorch/pytorch#135712)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    ps = [Proc([sys.executable, "-m", "bench.rdzv_scale", "--c10d-child", "127.0.0.1", str(store.port), run_id,
                str(lo), str(hi), str(n), json.dumps(knobs or TORCHRUN_BEST)], events) for lo, hi in slices]
    label = "best" if (knobs or TORCHRUN_BEST) == TORCHRUN_BEST else "default"
    out = {"system": f"c10d {label}", "nodes": n, "procs": len(ps), "settings": knobs or TORCHRUN_BEST}
    try:
        ready = _collect(events, lambda g: sum(e["event"] == "connected" for e in g) == len(ps), 120)
        if sum(e["event"] == "connected" for e in ready) < len(ps):
            raise RuntimeError("c10d handlers did not start within 120 s")
        t0 = time.time()
        for p in ps:
            p.send("join")
        got = _collect(events, lambda g: sum(e["event"] in ("round", "error") for e in g) >= n, cap)
        rounds = [e for e in got if e["event"] == "round" and e["world"] == n]
        errors = [e for e in got if e["event"] == "error"]
        if len(rounds) < n:
            out.update(join_s=None, note=f"{len(rounds)} of {n} handlers agreed within {cap:.0f} s"
                       + (f"; first error: {errors[0]['error'][:160]}" if errors else ""))
            return out
        out["join_s"] = round(max(e["t"] for e in rounds) - t0, 3)
        victim = n // 2
        owner = next(i for i, (lo, hi) in enumerate(slices) if lo <= victim < hi)
        ps[owner].send(f"kill {victim}")
        for p in ps:
            p.send("rejoin")
        got = _collect(events, lambda g: sum(e["event"] in ("round", "error") for e in g) >= n - 1, cap)
        killed = [e["t"] for e in got if e["event"] == "killed"]
        rounds = [e for e in got if e["event"] == "round" and e["world"] == n - 1]
        if len(rounds) < n - 1 or not killed:
            out.update(loss_s=None, note=f"{len(rounds)} of {n - 1} survivors agreed within {cap:.0f} s")
        else:
            out["loss_s"] = round(max(e["t"] for e in rounds) - killed[0], 3)
        return out
    finally:
        for p in ps:
            p.close()
        del store


# -- entry -------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    if argv and argv[0] == "--c10d-child":
        return c10d_child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench rdzv_scale", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,256", help="simulated node counts (default 16,64,256)")
    p.add_argument("--torchrun-sizes", default=None, help="sizes to run torchrun's c10d at (default: the same)")
    p.add_argument("--c10d", default="best,default", help="torchrun settings to run: best, default or both "
                   "(default best,default)")
    p.add_argument("--procs", type=int, default=4, help="processes the simulated nodes are spread over (default 4)")
    p.add_argument("--cap", type=float, default=60.0, help="seconds a phase may take before it is recorded "
                   "as not finished (default 60)")
    p.add_argument("--out", default=None, help="JSON result path (default bench/results/rdzv-scale-<time>.json)")
    p.add_argument("--lease-ttl", type=float, default=5.0,
                   help="the simulated nodes' lease TTL (default 5, as ftrt launch). Every node's keep-alive runs "
                        "on this machine's cores: a longer TTL keeps thousands of them from starving the rest")
    p.add_argument("--pin", action="store_true",
                   help="give etcd the first core to itself and the simulated nodes the others (sched_setaffinity): "
                        "shows which side the machine's cores bound")
    args = p.parse_args(argv)
    from ftrt.store.etcd_server import EtcdServer

    if args.pin and len(os.sched_getaffinity(0)) < 2:
        p.error("--pin needs at least 2 cores")

    sizes = [int(s) for s in args.sizes.split(",")]
    tsizes = [int(s) for s in (args.torchrun_sizes or args.sizes).split(",")]
    results = []
    with EtcdServer(name="bench-scale", unsafe_no_fsync=True, log_path=os.environ.get("FTRT_BENCH_ETCD_LOG")) as etcd:
        if args.pin and etcd.proc is not None:
            pin_process(etcd.proc.pid, [min(os.sched_getaffinity(0))])
        for n in sizes:
            procs = max(1, min(args.procs, n // 8))
            r = run_ftrt(n, procs, etcd.endpoint, args.cap, args.lease_ttl, etcd.proc.pid if etcd.proc else None,
                         pin=args.pin)
            print(f"ftrt          {n:>4} nodes: {r}", flush=True)
            results.append(r)
            chosen = [k for name, k in (("best", TORCHRUN_BEST), ("default", TORCHRUN_DEFAULT))
                      if name in args.c10d.split(",")]
            for knobs in chosen if n in tsizes else ():
                r = run_torchrun(n, procs, args.cap, knobs)
                print(f"{r['system']:<13} {n:>4} nodes: {r}", flush=True)
                results.append(r)
    _table(results)
    record = {"bench": "rdzv_scale", "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
              "command": "python -m bench rdzv_scale " + " ".join(argv), "results": results}
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"rdzv-scale-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _table(results: list[dict]) -> None:
    by = {(r["system"], r["nodes"]): r for r in results}
    print(f"\n{'nodes':>5} | {'join: ftrt':>10} {'c10d best':>10} {'c10d dflt':>10} | {'loss: ftrt':>10} "
          f"{'c10d best':>10} {'c10d dflt':>10} | {'decider':>9} | {'etcd req':>8} {'per node':>8} {'watch events':>12}")
    for n in sorted({r["nodes"] for r in results}):
        f = by.get(("ftrt", n), {})
        row = [f"{n:>5} |"]
        for key in ("join_s", "loss_s"):
            row.append(f"{_fmt(f.get(key)):>10}")
            for sys_ in ("c10d best", "c10d default"):
                t = by.get((sys_, n))
                v = None if t is None else t.get(key)
                cell = "not run" if t is None else "no finish" if v is None else \
                    f"{v:.2f}s" + (f" {v / f[key]:.0f}x" if f.get(key) else "")
                row.append(f"{cell:>10}")
            row.append("|")
        row.append(f"{_fmt(f.get('decider_loss_s')) if f else 'not run':>9} |")
        req = f.get("join_etcd", {}).get("requests")
        row.append(f"{req if req is not None else 'n/a':>8} {req / n if req else 0:>8.1f} "
                   f"{f.get('join_etcd', {}).get('watch_events', 'n/a'):>12}")
        print(" ".join(row))
    print("(Nx: that run's time / ftrt's; c10d best: last_call 1 s, keep-alive 1 s x 3; default: 30 s, 5 s x 3; "
          "decider: ftrt's loss of the node that decides rounds; "
          "etcd requests of the join, lease keep-alives apart)")


def _fmt(v) -> str:
    return "no finish" if v is None else f"{v:.3f}s"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
