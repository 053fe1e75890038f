"""Recovery benchmark: ftrt and torchrun side by side on the same script, in the same run.

The workload is ``ftrt/examples/ddp_steps.py`` (gloo DDP, ~50 ms steps) on 3 simulated nodes of 1
worker each, every rank logging a line per step. For each scenario and system the bench starts a
fresh cluster, waits until it trains (and, for ftrt, until its spare workers are warm), injects the
fault, and reads the step logs:

- ``node_loss``: SIGKILL a node's agent and workers; time until every survivor steps at world 2.
- ``node_loss_rank0``: the same for the node holding rank 0 (and, for ftrt, the round's TCPStore).
- ``worker_crash``: a worker exits 1 (its agent lives); time until every rank steps again.
- ``node_join``: 2 nodes train, a 3rd agent starts; time from its start until 3 ranks step, and
  the longest pause the running ranks saw.
- ``node_freeze``: SIGSTOP a node's whole tree; time until the survivors step at world 2.
- ``node_loss_early``: ``node_loss`` 15 steps after the job's first step, without waiting for
  spares (``spares_warm_at_fault`` says whether they were).
- ``fault_during_warmup``: a worker crash restarts every node's workers (ftrt's spares are used
  and refill), and 1 s after every rank steps again a node is killed: its recovery, as
  ``node_loss`` measures it, while spares are still warming (``first_recovery_s``: the crash's).
- ``drain`` / ``drain_rank0``: SIGTERM to one node's agent (Kubernetes deleting a pod), the script
  saving every 10 steps and ending a round at a step boundary when ftrt asks (``--boundary``;
  torchrun never asks); time until the survivors step at world 2, their longest pause, the
  steps trained twice (``redone``), and the agent's exit code and time to exit (``exit_s``).

``torchft`` (``pip install -e ".[bench]"``) is the strongest peer that keeps its survivors: one
replica group per node under its own torchrun, a lighthouse at its best settings
(:mod:`bench.torchft_baseline`), the same model and steps (:mod:`bench.torchft_worker`).

``ftrt-inplace`` is ftrt with the script changing rounds in place (``ddp_steps.py --in-place``,
``ftrt launch --recovery in-place``): the survivors keep their processes; each row says whether
how many of them stepped on in the same processes (``kept``) and how many steps were trained again (``redone``). With
``--compile`` the model is ``torch.compile``d, so a worker's start includes compiling it (inductor's
on-disk cache is warm after the first run) and recovery that restarts workers pays it again.

torchrun runs its c10d rendezvous as usually deployed: the first node's agent hosts the rendezvous
TCPStore (``is_host=true``; the others ``false``), with its best settings
(``last_call_timeout=1, keep_alive_interval=1, keep_alive_max_attempt=3``, ``--monitor-interval
0.1``); ``node_loss`` is also run once with torchrun's defaults. ``node_loss`` kills a node that
holds neither rank 0 nor the rendezvous store; when rank 0 lives on the store's host, torchrun's
``node_loss_rank0`` cannot recover (the store is gone), and the table says so. torchrun gets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with its default, restarted workers read stale gloo
addresses from the shared store and never reconnect (pytorch/pytorch#135712).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftrt import progress
from ftrt.agents.peers.tls import AgentTls
from ftrt.chaos.local import LocalNode, StepLog, spares_warm, wait_until

from ftrt.store.certs import tls_dir
from ftrt.store.etcd_server import EtcdServer, free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ftrt" / "examples" / "ddp_steps.py"
TORCHRUN_BEST = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
SCENARIOS = ("node_loss", "node_loss_rank0", "worker_crash", "node_join", "node_freeze", "node_loss_early",
             "fault_during_warmup", "drain", "drain_rank0")
DRAIN_SCRIPT = ("--boundary", "--ckpt-every", "10")
"""``drain``: the script saves every 10 steps and ends a round at a step boundary when asked."""
EARLY_STEPS = 15
"""``node_loss_early``: steps after the first one at which the node is killed."""
SECOND_FAULT_AFTER_S = 1.0
"""``fault_during_warmup``: seconds from the crash's recovery to the node kill."""
LOG_ROOT = ROOT / "bench" / "results" / "logs"
"""Every run's agent logs are kept here, so an outlier can be explained afterwards."""
CAP = 90.0  # seconds a recovery may take before the run is recorded as "no recovery"


ETCD_MODES = ("open", "closed", "tls-auth")
"""How a bench cluster's etcd admits clients (:class:`Cluster`)."""


class Cluster:
    """Nodes of one system (ftrt or torchrun) sharing a step log."""

    def __init__(self, system: str, work: Path, *, nnodes: str = "2:3", torchrun_conf: str = TORCHRUN_BEST,
                 workload: str = "ddp", max_restarts: int = 10, launch_extra: tuple[str, ...] = (),
                 env_extra: dict[str, str] | None = None, etcd: str = "open",
                 script_extra: tuple[str, ...] = ()):
        self.system = system
        self.script_extra = script_extra
        self.launch_extra = list(launch_extra)  # more ``ftrt launch`` options (ftrt only)
        self.max_restarts = max_restarts
        self.workload = workload
        self.work = work
        self.nnodes = nnodes
        self.torchrun_conf = torchrun_conf
        self.log = StepLog(work / "steps.jsonl")
        self.marker = work / "fault.json"
        self.nodes: dict[str, LocalNode] = {}
        self.env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        if system == "torchrun":
            # Without this, torchrun's restarts reuse the rendezvous TCPStore for the workers and
            # they read stale gloo addresses (pytorch/pytorch#135712); restarts never succeed.
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self._etcd: EtcdServer | None = None
        if system == "ftrt":
            # etcd (ETCD_MODES): open; closed as ftrt etcd runs it by default (TLS, client
            # certificates); or tls-auth, with etcd's auth on too, as production runs it.
            if etcd not in ETCD_MODES:
                raise ValueError(f"etcd={etcd!r}: choose from {ETCD_MODES}")
            self._etcd = EtcdServer(name="bench", unsafe_no_fsync=True,
                                    tls=tls_dir(work / "tls") if etcd != "open" else None).start()
            if etcd == "closed":
                self.launch_extra += self._etcd.access().flags()
            elif etcd == "tls-auth":  # and mutual TLS between the agents: TLS everywhere
                files = tls_dir(work / "tls")
                agents = AgentTls(str(files.server_cert), str(files.server_key), str(files.ca))
                self.launch_extra += [*self._etcd.secure_access(work, "bench").flags(), *agents.flags()]
            else:
                self.launch_extra.append("--insecure-etcd")
        else:
            self._port = free_port()

    def script_args(self, steps: int) -> list[str]:
        return [
            str(SCRIPT), "--steps", str(steps), "--step-time", "0.05", "--progress", str(self.log.path),
            "--all-ranks", "--ckpt", str(self.work / "ckpt.json"), "--fault-marker", str(self.marker),
            "--fail-when", str(self.work / "arm"), "--fail-rank", "1",
            *(["--plain"] if self.workload == "plain" else []), *self.script_extra,
        ]

    def add(self, node_id: str, script: list[str]) -> LocalNode:
        if self.system == "ftrt":
            node = LocalNode(self.work, node_id, [
                "--etcd", self._etcd.url, "--job-id", "bench", "--nnodes", self.nnodes,
                "--lease-ttl", "2", "--max-restarts", str(self.max_restarts),
                # The plain workload never imports torch._dynamo, so spares need not either.
                *(["--warm-import", "torch", "--warm-import", "torch.distributed"] if self.workload == "plain" else []),
                *self.launch_extra, *script,
            ], env=self.env)
        else:
            node = LocalNode(self.work, node_id, [], env=self.env, command=[
                sys.executable, "-m", "torch.distributed.run", "--nnodes", self.nnodes,
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self._port}", "--rdzv-id", "bench",
                "--rdzv-conf", ",".join(filter(None, [self.torchrun_conf, f"is_host={not self.nodes}".lower()])),
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1", *script,
            ])
        self.nodes[node_id] = node.start()
        return node

    @property
    def etcd_pid(self) -> int | None:
        """The pid of the cluster's etcd member (ftrt only)."""
        return self._etcd.proc.pid if self._etcd is not None and self._etcd.proc is not None else None

    def spares_warm(self) -> bool:
        """Every live agent has its spare workers warm, by its own ``Status`` (torchrun has none)."""
        if self.system != "ftrt" or "--no-warm" in self.launch_extra:
            return True
        return spares_warm(n for n in self.nodes.values() if n.alive())

    def node_of_rank(self, rank: int, since: float = 0.0) -> str:
        """The node whose process tree holds the worker that last logged ``rank``."""
        pid = [x["pid"] for x in self.log.after(since) if x["rank"] == rank][-1]
        for nid, node in self.nodes.items():
            if pid in node.tree():
                return nid
        raise RuntimeError(f"no node holds pid {pid}")

    def victim(self, rank0: bool) -> str:
        """The node to fault: the one holding rank 0, or one holding neither rank 0 nor torchrun's store."""
        since = time.time() - 1
        holder = self.node_of_rank(0, since)
        if rank0:
            return holder
        return next(n for n in ("n1", "n2", "n0") if n != holder and (self.system == "ftrt" or n != "n0"))

    def close(self) -> None:
        for n in self.nodes.values():
            n.cleanup()
        if self._etcd is not None:
            self._etcd.stop()


def _train(c: Cluster, names: list[str], steps: int, *, warm: bool = True) -> None:
    for name in names:
        c.add(name, c.script_args(steps))
    wait_until(lambda: c.log.stepping(world=len(names), ranks=len(names)), 120, "training to start")
    if not warm:
        return
    wait_until(c.spares_warm, 120, "spare workers to be warm", interval=0.25)
    time.sleep(1.0)  # a stretch of steady training before the fault


SYSTEMS = ("ftrt", "ftrt-inplace", "ftrt-closed", "ftrt-tls", "torchrun", "torchft")
"""What ``--systems`` may name: ``ftrt-closed`` is ftrt's defaults (in place, etcd closed as ``ftrt
etcd`` runs it), to hold against ``ftrt-inplace`` (the same on an open etcd)."""


def measure(system: str, scenario: str, *, torchrun_conf: str = TORCHRUN_BEST, workload: str = "ddp",
            compile: bool = False) -> dict:
    """Run one scenario once on a fresh cluster; return its measurements (seconds)."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{system}-{scenario}-"))
    extra = (*(DRAIN_SCRIPT if scenario.startswith("drain") else ()), *(("--compile",) if compile else ()),
             *(("--in-place",) if system in ("ftrt-inplace", "ftrt-closed") else ("--no-in-place",)
               if system != "torchft" else ()))
    if system == "torchft":
        from bench.torchft_baseline import TorchftCluster

        c = TorchftCluster(work, workload=workload, script_extra=extra)
    else:
        c = Cluster("ftrt" if system.startswith("ftrt") else system, work, torchrun_conf=torchrun_conf,
                    workload=workload, script_extra=extra,
                    etcd={"ftrt-tls": "tls-auth", "ftrt-closed": "closed"}.get(system, "open"))
    result: dict = {"system": system, "scenario": scenario, "workload": workload, "compiled": compile}
    try:
        if scenario in ("node_loss", "node_loss_rank0", "node_freeze"):
            _train(c, ["n0", "n1", "n2"], steps=100000)
            victim = c.victim(rank0=scenario == "node_loss_rank0")
            result["victim_hosted_store"] = c.system == "torchrun" and victim == "n0"
            t0 = c.nodes[victim].freeze() if scenario == "node_freeze" else c.nodes[victim].kill()
            first = _wait_or_none(lambda: c.log.stepping(world=2, ranks=2, since=t0))
            result["recovery_s"] = round(max(first.values()) - t0, 3) if first else None
            result.update(_survivors(c.log, t0, first))
        elif scenario == "node_loss_early":
            _train(c, ["n0", "n1", "n2"], steps=100000, warm=False)
            first_step = min(x["step"] for x in c.log.lines())
            wait_until(lambda: max(x["step"] for x in c.log.lines()) >= first_step + EARLY_STEPS, 60,
                       f"{EARLY_STEPS} steps")
            result["spares_warm_at_fault"] = c.spares_warm()
            t0 = c.nodes[c.victim(rank0=False)].kill()
            first = _wait_or_none(lambda: c.log.stepping(world=2, ranks=2, since=t0))
            result["recovery_s"] = round(max(first.values()) - t0, 3) if first else None
        elif scenario in ("worker_crash", "fault_during_warmup"):
            _train(c, ["n0", "n1", "n2"], steps=100000)
            # Arm the crash now that spares are warm: rank 1 exits at a step a little ahead.
            current = max(x["step"] for x in c.log.lines())
            (work / "arm").write_text(str(current + 10))
            crash = _wait_or_none(lambda: json.loads(c.marker.read_text()) if c.marker.exists() else None)
            if crash is None:
                raise RuntimeError("the crash was not injected")
            t0 = crash["time"]
            first = _wait_or_none(lambda: _stepping_in_a_new_round(c.log, t0, 3))
            result["recovery_s"] = round(max(first.values()) - t0, 3) if first else None
            result.update(_survivors(c.log, t0, first, lost={crash["pid"]}))
            if scenario == "fault_during_warmup" and first:
                result["first_recovery_s"] = result["recovery_s"]
                time.sleep(max(0.0, max(first.values()) + SECOND_FAULT_AFTER_S - time.time()))
                result["spares_warm_at_fault"] = c.spares_warm()
                victim = c.victim(rank0=False)
                t1 = c.nodes[victim].kill()
                result["after_first_s"] = round(t1 - t0, 3)
                second = _wait_or_none(lambda: c.log.stepping(world=2, ranks=2, since=t1))
                result["recovery_s"] = round(max(second.values()) - t1, 3) if second else None
        elif scenario == "node_join":
            _train(c, ["n0", "n1"], steps=100000)
            joiner = c.add("n2", c.script_args(100000))
            t0 = joiner.started_at
            first = _wait_or_none(lambda: c.log.stepping(world=3, ranks=3, since=t0))
            result["recovery_s"] = round(max(first.values()) - t0, 3) if first else None
            if first:
                result["pause_s"] = round(_longest_pause(c.log, t0, max(first.values())), 3)
            result.update(_survivors(c.log, t0, first))
        elif scenario in ("drain", "drain_rank0"):
            _train(c, ["n0", "n1", "n2"], steps=100000)
            victim = c.victim(rank0=scenario == "drain_rank0")
            result["victim_hosted_store"] = c.system == "torchrun" and victim == "n0"
            t0 = time.time()
            c.nodes[victim].proc.send_signal(signal.SIGTERM)
            try:
                result["exit_code"] = c.nodes[victim].wait(60)
                result["exit_s"] = round(time.time() - t0, 3)
            except subprocess.TimeoutExpired:
                result["exit_code"] = result["exit_s"] = None
            first = _wait_or_none(lambda: c.log.stepping(world=2, ranks=2, since=t0))
            result["recovery_s"] = round(max(first.values()) - t0, 3) if first else None
            if first:
                result["pause_s"] = round(_longest_pause(c.log, t0, max(first.values())), 3)
                time.sleep(1.0)  # a few steps at world 2, so a step trained twice shows
            steps = [x["step"] for x in c.log.lines() if x["rank"] == 0]
            result["redone"] = len(steps) - len(set(steps))
            result["kept"] = _survivors(c.log, t0, first)["kept"]
        else:
            raise ValueError(scenario)
    finally:
        c.close()
        logs = LOG_ROOT / f"{system}-{scenario}-{time.strftime('%H%M%S')}"
        logs.mkdir(parents=True, exist_ok=True)
        for f in work.glob("agent-*.log"):
            shutil.copy(f, logs / f.name)
        result["logs"] = str(logs.relative_to(ROOT)) if logs.is_relative_to(ROOT) else str(logs)
        if os.environ.get("FTRT_BENCH_KEEP"):
            result["work"] = str(work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _wait_or_none(pred):
    try:
        return wait_until(pred, CAP, "recovery")
    except AssertionError:
        return None


def _stepping_in_a_new_round(log: StepLog, t0: float, ranks: int) -> dict[int, float] | None:
    """The first step of each rank in a round newer than the one running at ``t0`` (workers kept in
    place or restarted alike), once ``ranks`` ranks stepped in it."""
    old = max((x["round"] for x in log.lines() if x["time"] <= t0), default=0)
    first: dict[int, float] = {}
    for x in log.after(t0):
        if x["round"] > old:
            first.setdefault(x["rank"], x["time"])
    return first if len(first) >= ranks else None


def _survivors(log: StepLog, t0: float, first: dict[int, float] | None, lost: set[int] = frozenset()) -> dict:
    """``kept``: how many processes that stepped in the second before ``t0`` (less the ``lost``
    ones) step again after the recovery, i.e. were not restarted (2 of 2 in every scenario when
    survivors keep their processes); ``redone``: steps trained again after it (the newest step
    before ``t0`` minus the first one of the new round, plus one; 0 when none)."""
    if not first:
        return {"kept": None, "redone": None}
    before = [x for x in log.lines() if x["time"] <= t0]
    old_round = max(x["round"] for x in before)
    after = [x for x in log.after(t0) if x["round"] > old_round]
    old_pids = {x["pid"] for x in before if x["time"] >= t0 - 1.0} - set(lost)
    newest = max(x["step"] for x in before)
    resumed = min((x["step"] for x in after), default=newest + 1)
    return {"kept": len(old_pids & {x["pid"] for x in after}), "redone": max(0, newest - resumed + 1)}


def _longest_pause(log: StepLog, t0: float, t1: float) -> float:
    """Longest gap between consecutive steps of any rank that was training before ``t0``."""
    before = [x for x in log.lines() if x["time"] <= t0]
    ranks_before = {x["rank"] for x in before}
    times = sorted(x["time"] for x in log.lines() if t0 - 1 <= x["time"] <= t1 + 0.5 and x["rank"] in ranks_before)
    # The union of all old ranks' step times: the longest stretch in which none of them stepped.
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def run(reps: int = 3, scenarios: tuple[str, ...] = SCENARIOS, torchrun_defaults: bool = True,
        workload: str = "ddp", systems: tuple[str, ...] = ("ftrt", "torchrun"), compile: bool = False) -> dict:
    rows = []
    with progress.bar(len(scenarios) * len(systems) * reps, "recovery", "run") as shown:
        for scenario in scenarios:
            for system in systems:
                for rep in range(reps):
                    r = measure(system, scenario, workload=workload, compile=compile)
                    r["rep"] = rep
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    shown.update()
    if torchrun_defaults and "torchrun" in systems:
        r = measure("torchrun", "node_loss", torchrun_conf="", workload=workload, compile=compile)
        r.update(rep=0, settings="defaults")
        rows.append(r)
        print(json.dumps(r), flush=True)
    return {"rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        entry: dict = {"scenario": scenario}
        for system in dict.fromkeys(r["system"] for r in rows):
            vals = [r["recovery_s"] for r in rows
                    if r["scenario"] == scenario and r["system"] == system and "settings" not in r]
            ok = [v for v in vals if v is not None]
            entry[system] = {
                "median_s": round(statistics.median(ok), 3) if ok else None,
                "min_s": min(ok) if ok else None, "max_s": max(ok) if ok else None,
                "runs": len(vals), "no_recovery": len(vals) - len(ok),
            }
            pauses = [r["pause_s"] for r in rows if r["scenario"] == scenario and r["system"] == system and "pause_s" in r]
            if pauses:
                entry[system]["median_pause_s"] = round(statistics.median(pauses), 3)
            kept = [r["kept"] for r in rows if r["scenario"] == scenario and r["system"] == system
                    and r.get("kept") is not None]
            if kept:
                entry[system]["kept"] = kept
            mine = [r for r in rows if r["scenario"] == scenario and r["system"] == system and "redone" in r]
            if mine:  # the steps trained again; for a drain, also what the departing agent did
                entry[system]["redone"] = [r["redone"] for r in mine]
            if any("exit_code" in r for r in mine):
                entry[system].update(exit_codes=[r["exit_code"] for r in mine], exit_s=[r["exit_s"] for r in mine])
        f, t = entry.get("ftrt", {}).get("median_s"), entry.get("torchrun", {}).get("median_s")
        entry["speedup"] = round(t / f, 1) if f and t else None
        s = entry.get("ftrt-tls", {}).get("median_s")
        if f and s:
            entry["tls_ratio"] = round(s / f, 3)  # ftrt with etcd over TLS and auth, over without
        i = entry.get("ftrt-inplace", {}).get("median_s")
        if i and f:
            entry["inplace_ratio"] = round(i / f, 3)  # in place over restarting every worker
        c = entry.get("ftrt-closed", {}).get("median_s")
        if i and c:
            entry["closed_ratio"] = round(c / i, 3)  # the defaults (closed etcd) over the same on an open one
        ft = entry.get("torchft", {}).get("median_s")
        if i and ft:
            entry["torchft_ratio"] = round(ft / i, 2)  # torchft's time over ftrt in place's
        out.append(entry)
    defaults = [r for r in rows if r.get("settings") == "defaults"]
    if defaults:
        out.append({"scenario": "node_loss (torchrun defaults)", "torchrun": {"median_s": defaults[0]["recovery_s"]}})
    return out


def render(summary: list[dict]) -> str:
    lines = [f"{'scenario':<32}{'ftrt median':>12}{'ftrt range':>16}{'torchrun median':>17}{'torchrun range':>18}{'ratio':>8}"]

    def fmt(v):
        return "none" if v is None else f"{v:.2f} s"

    for e in summary:
        f = e.get("ftrt", {})
        t = e.get("torchrun", {})
        fr = f"{fmt(f.get('min_s'))}-{fmt(f.get('max_s'))}" if f.get("min_s") is not None else ""
        tr = f"{fmt(t.get('min_s'))}-{fmt(t.get('max_s'))}" if t.get("min_s") is not None else ""
        ratio = f"{e['speedup']}x" if e.get("speedup") else ""
        lines.append(f"{e['scenario']:<32}{fmt(f.get('median_s')) if f else '':>12}{fr:>16}"
                     f"{fmt(t.get('median_s')) if t else '':>17}{tr:>18}{ratio:>8}")
        s = e.get("ftrt-tls", {})
        if s.get("median_s") is not None:
            lines.append(f"{'':<4}ftrt with TLS everywhere (etcd TLS + auth, agent mTLS): {fmt(s['median_s'])} "
                         f"({fmt(s['min_s'])}-{fmt(s['max_s'])}), {e.get('tls_ratio', '-')}x ftrt without")
        cl = e.get("ftrt-closed", {})
        if cl.get("median_s") is not None:
            lines.append(f"{'':<4}ftrt's defaults, etcd closed (TLS, client certificates): {fmt(cl['median_s'])} "
                         f"({fmt(cl['min_s'])}-{fmt(cl['max_s'])}), {e.get('closed_ratio', '-')}x in place on an "
                         "open etcd")
        ip = e.get("ftrt-inplace", {})
        if ip.get("median_s") is not None:
            lines.append(f"{'':<4}ftrt in place (survivors keep their processes): {fmt(ip['median_s'])} "
                         f"({fmt(ip['min_s'])}-{fmt(ip['max_s'])}), {e.get('inplace_ratio', '-')}x ftrt restarting them")
        tf = e.get("torchft", {})
        if tf.get("median_s") is not None:
            lines.append(f"{'':<4}torchft: {fmt(tf['median_s'])} ({fmt(tf['min_s'])}-{fmt(tf['max_s'])})"
                         + (f", {e['torchft_ratio']}x ftrt in place" if e.get("torchft_ratio") else ""))
        for sysname, d in (("ftrt", f), ("ftrt-inplace", ip), ("ftrt-tls", s), ("torchrun", t), ("torchft", tf)):
            if d.get("median_pause_s") is not None:
                lines.append(f"{'':<4}{sysname} running ranks' longest pause: {d['median_pause_s']:.2f} s (median)")
            if d.get("exit_codes") is not None:
                lines.append(f"{'':<4}{sysname}: steps redone {d['redone']}, the drained agent exited "
                             f"{d['exit_codes']} after {d['exit_s']} s")
            elif d.get("redone") is not None:
                lines.append(f"{'':<4}{sysname}: steps redone per run {d['redone']}")
            if d.get("kept") is not None:
                lines.append(f"{'':<4}{sysname}: processes that stepped on unrestarted, per run: {d['kept']}")
            if d.get("no_recovery"):
                lines.append(f"{'':<4}{sysname}: {d['no_recovery']} of {d['runs']} runs did not recover within {CAP:.0f} s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench recovery", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scenario", action="append", choices=SCENARIOS)
    p.add_argument("--no-torchrun-defaults", dest="defaults", action="store_false")
    p.add_argument("--workload", choices=("ddp", "plain"), default="ddp",
                   help="ddp: DDP + SGD (imports torch._dynamo); plain: hand-written all-reduce, no dynamo")
    p.add_argument("--systems", default="ftrt,torchrun",
                   help="comma-separated, of ftrt, ftrt-inplace (the script changes rounds in place: survivors "
                        "keep their processes), ftrt-tls (etcd over TLS with client certificates and auth, "
                        "and mutual TLS between agents), ftrt-closed (in place, etcd closed as ftrt etcd runs it: "
                        "the defaults), torchrun and torchft (pip install -e '.[bench]'; "
                        "default ftrt,torchrun)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model, so that starting a worker costs what it costs with compiled graphs")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    if not systems or set(systems) - set(SYSTEMS):
        p.error(f"--systems {args.systems!r}: choose from {', '.join(SYSTEMS)}")
    t0 = time.time()
    res = run(args.reps, tuple(args.scenario or SCENARIOS), args.defaults, args.workload, systems, args.compile)
    res.update(
        date=time.strftime("%Y-%m-%d %H:%M"), machine=f"{os.cpu_count()} cores",
        command="python -m bench recovery " + " ".join(argv), wall_s=round(time.time() - t0),
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"{args.workload}{'-compiled' if args.compile else ''}"
    path = Path(args.out) / f"recovery-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print()
    print(render(res["summary"]))
    print(f"\nwrote {path}")
    return 0
