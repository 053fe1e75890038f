"""Run one chaos scenario: start the cluster, train, inject the faults, check the invariants.

The job is the built-in GRPO trainer under ``ftrt launch`` on local nodes (one agent each, as
:class:`~ftrt.chaos.local.LocalNode`), on an etcd the runner starts (1 or 3 members). Faults
fire when rank 0's metrics reach ``at_step`` (or ``at_s`` after the first step). Recovery of a
fault is the time from its injection to the end of the first step that started after it (rank
0's metrics). A due fault first waits (at most a minute) for every live agent's spare workers to be
warm, as they are when faults come minutes apart in a long job. At the end:

- ``final_step``: every step 0..steps-1 was trained, the job exited 0;
- ``recovered``: every fault was followed by a step within ``expect.max_recovery_s``;
- ``checkpoints_verify``: every committed checkpoint verifies, except the ones a fault damaged
  on purpose (those must fail verification);
- ``ledger``: the trained prompts have no gap and no repeat;
- ``equivalence``: per ``expect.equivalence`` (``exact``: a fault-free run of the same job is run
  first and every step's metrics must match it bit for bit; ``ledger``: each step trained the
  same prompts as a fault-free run does);
- ``no_process_left``: no process the run started is still alive;
- ``no_stale_keys``: no key under the job's etcd prefix is still attached to a lease.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ftrt.chaos.faults import Context, Injected, injector
from ftrt.chaos.local import LocalNode, read_jsonl
from ftrt.chaos.scenario import Scenario

WARM_WAIT_S = 60.0
"""Longest a due fault waits for every live agent's spare workers to be warm."""

EXACT_FIELDS = ("step", "reward_mean", "loss", "kl", "world_size", "prompt_ids")


@dataclass
class FaultRecord:
    kind: str
    target: str
    at: float  # seconds since the first step
    step: int  # rank 0's last logged step when injected
    detail: str = ""
    recovery_s: float | None = None
    ended_at: float | None = None


@dataclass
class Report:
    scenario: str
    passed: bool
    seed: int
    faults: list[FaultRecord] = field(default_factory=list)
    invariants: dict[str, dict] = field(default_factory=dict)
    goodput: float | None = None
    wall_s: float = 0.0
    steps: int = 0
    world_sizes: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


_lines = read_jsonl


class ChaosRun:
    """One scenario run in ``work`` (its own etcd, nodes, checkpoints and metrics)."""

    def __init__(self, sc: Scenario, work: Path, seed: int = 0, log=print) -> None:
        self.sc, self.work, self.seed, self.log = sc, Path(work), seed, log
        self.rng = random.Random(seed)

    # -- cluster -----------------------------------------------------------------------------
    def _start_etcd(self):
        from ftrt.store.etcd_server import EtcdCluster, EtcdServer

        if self.sc.cluster.etcd_members == 3:
            return EtcdCluster(3, unsafe_no_fsync=True).start()
        return EtcdServer(name="chaos", unsafe_no_fsync=True, log_path=str(self.work / "etcd.log")).start()

    def _launch_args(self, endpoints: str, job_id: str, run: str, max_nodes: int) -> list[str]:
        c = self.sc.cluster
        grpo = {**self.sc.job.grpo, "steps": self.sc.steps, "progress": "none", "seed": self.seed,
                "metrics_path": str(self.work / f"{run}-metrics.jsonl"),
                "checkpoint.url": str(self.work / f"{run}-ckpt")}
        return ["--etcd", endpoints, "--job-id", job_id, "--nnodes", f"{c.min_nodes or 1}:{max_nodes}",
                "--nproc-per-node", str(c.workers_per_node), "--lease-ttl", str(c.lease_ttl),
                "--hang-timeout", str(c.hang_timeout), "--first-round-wait", "5", "-m", "ftrt.grpo",
                *(f"{k}={_yaml(v)}" for k, v in grpo.items())]

    # -- one job -----------------------------------------------------------------------------
    def _job(self, run: str, with_faults: bool, deadline: float):
        """Run the job once; return (metrics lines, fault records, exit codes, context, pids seen)."""
        sc = self.sc
        etcd = self._start_etcd()
        endpoints = getattr(etcd, "endpoints", None) or etcd.endpoint
        job_id = f"chaos-{run}"
        max_nodes = sc.cluster.nodes + sum(f.kind == "add_node" for f in sc.faults) if with_faults else sc.cluster.nodes
        args = self._launch_args(endpoints, job_id, run, max_nodes)
        metrics = self.work / f"{run}-metrics.jsonl"

        def start_node(name: str) -> LocalNode:
            node = LocalNode(self.work, name, args)
            node.log_path = self.work / f"{run}-agent-{name}-{int(time.time() * 1000) % 100000}.log"
            return node.start()

        nodes = {f"node{i}": start_node(f"node{i}") for i in range(sc.cluster.nodes)}
        ctx = Context(nodes, etcd, endpoints, job_id, self.work / f"{run}-ckpt", self.rng, start_node)
        pending = list(sc.faults) if with_faults else []
        records: list[FaultRecord] = []
        ends: list[tuple[float, FaultRecord, Injected]] = []
        seen_pids: set[int] = set()
        t_first: float | None = None
        warm_wait: float | None = None
        codes: dict[str, int | None] = {}
        try:
            while time.monotonic() < deadline:
                lines = _lines(metrics)
                now = time.time()
                if lines and t_first is None:
                    t_first = lines[0]["time"] - lines[0].get("step_s", 0.0)
                last_step = lines[-1]["step"] if lines else -1
                for node in nodes.values():
                    if node.alive():
                        seen_pids.update(node.tree())
                for f in list(pending):
                    due = (f.at_step is not None and last_step >= f.at_step) or \
                          (f.at_s is not None and t_first is not None and now - t_first >= f.at_s)
                    if not due:
                        continue
                    # Like a long job's faults, each meets agents whose spare workers are warm (a
                    # fault seconds after a restart would measure spare warm-up instead); bounded.
                    if not all(n.spares_warm() for n in nodes.values() if n.alive()):
                        if warm_wait is None:
                            warm_wait = time.monotonic() + WARM_WAIT_S
                        if time.monotonic() < warm_wait:
                            continue
                        self.log(f"[chaos] spares still warming after {WARM_WAIT_S:.0f} s; injecting anyway")
                    warm_wait = None
                    pending.remove(f)
                    try:
                        inj = injector(f.kind)(ctx, f)
                    except Exception as exc:  # noqa: BLE001 - a fault that cannot be injected is a finding
                        records.append(FaultRecord(f.kind, f.target, round(now - (t_first or now), 3), last_step,
                                                   f"not injected: {exc}"))
                        self.log(f"[chaos] {f.kind} could not be injected: {exc}")
                        continue
                    rec = FaultRecord(f.kind, inj.target, round(now - (t_first or now), 3), last_step, inj.detail)
                    records.append(rec)
                    self.log(f"[chaos] {rec.at:7.2f} s  step {last_step:>4}  {f.kind} -> {inj.target}: {inj.detail}")
                    if inj.end is not None:
                        ends.append((time.monotonic() + (f.duration_s or 0.0), rec, inj))
                for item in list(ends):
                    if time.monotonic() >= item[0]:
                        ends.remove(item)
                        item[2].end()
                        item[1].ended_at = round(time.time() - (t_first or time.time()), 3)
                        self.log(f"[chaos] {item[1].ended_at:7.2f} s  {item[1].kind} on {item[1].target} ended")
                if not pending and not ends and not any(n.alive() for n in nodes.values()):
                    break
                time.sleep(0.05)
            for item in ends:  # the run is over: end what is still going on
                item[2].end()
            codes = {n: node.proc.poll() for n, node in nodes.items()}
            stale = asyncio.run(_leased_keys(endpoints, job_id))
        finally:
            for node in nodes.values():
                node.cleanup()
            etcd.stop()
        lines = _lines(metrics)
        t0 = t_first or (lines[0]["time"] if lines else time.time())
        for rec in records:  # recovery: the end of the first step that started after the fault
            after = [x for x in lines if x["time"] - x.get("step_s", 0.0) - t0 > rec.at]
            rec.recovery_s = round(after[0]["time"] - t0 - rec.at, 3) if after else None
        return lines, records, codes, ctx, seen_pids, stale, t0

    def run(self) -> Report:
        sc = self.sc
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        t_start = time.monotonic()
        deadline = t_start + sc.timeout_s
        reference = None
        if sc.expect.equivalence == "exact":
            self.log(f"[chaos] {sc.name}: fault-free reference run first (equivalence: exact)")
            reference, *_ = self._job("reference", False, deadline)
        self.log(f"[chaos] {sc.name}: {sc.description}")
        lines, records, codes, ctx, pids, stale, t0 = self._job("run", True, deadline)
        inv: dict[str, dict] = {}

        def check(name: str, ok: bool, reason: str) -> None:
            inv[name] = {"ok": bool(ok), "reason": reason}

        steps = [x["step"] for x in lines]
        codes = {n: c for n, c in codes.items() if n not in ctx.killed}  # a SIGKILLed agent cannot exit 0
        check("final_step", steps == list(range(sc.steps)) and all(c == 0 for c in codes.values()),
              f"steps 0..{sc.steps - 1} trained once each, agents exited {codes}" if steps == list(range(sc.steps))
              else f"trained steps {_ranges(steps)} of 0..{sc.steps - 1}; agents exited {codes}")
        late = [r for r in records if r.recovery_s is None or r.recovery_s > sc.expect.max_recovery_s]
        injected = [r for r in records if not r.detail.startswith("not injected")]
        check("recovered", not late and len(injected) == len(sc.faults),
              f"{len(injected)}/{len(sc.faults)} faults injected; slowest recovery "
              f"{max((r.recovery_s or 0) for r in records) if records else 0:.2f} s "
              f"(limit {sc.expect.max_recovery_s} s)" + (f"; late: {[r.kind for r in late]}" if late else ""))
        ok, reason = _verify_checkpoints(ctx.ckpt_dir, ctx.corrupted_steps)
        check("checkpoints_verify", ok, reason)
        per = int(sc.job.grpo.get("prompts_per_step", 32))
        ledger = [i for x in lines for i in x["prompt_ids"]]
        check("ledger", sorted(ledger) == list(range(len(lines) * per)) and len(set(ledger)) == len(ledger),
              f"{len(ledger)} prompts, {len(ledger) - len(set(ledger))} repeated, "
              f"{len(set(range(len(lines) * per)) - set(ledger))} missing")
        if sc.expect.equivalence == "exact":
            diff = [a["step"] for a, b in zip(lines, reference or [])
                    if {k: a[k] for k in EXACT_FIELDS} != {k: b[k] for k in EXACT_FIELDS}]
            check("equivalence", not diff and len(lines) == len(reference or []),
                  "every step's reward, loss, kl and prompts equal the fault-free run's" if not diff
                  else f"steps {diff[:10]} differ from the fault-free run")
        elif sc.expect.equivalence == "ledger":
            wrong = [x["step"] for x in lines if x["prompt_ids"] != list(range(x["step"] * per, (x["step"] + 1) * per))]
            check("equivalence", not wrong, "each step trained the fault-free run's prompts" if not wrong
                  else f"steps {wrong[:10]} trained other prompts")
        left = _alive(pids)
        check("no_process_left", not left, "no process of the run is alive" if not left else f"still alive: {left}")
        check("no_stale_keys", not stale, "no leased key left under the job's prefix" if not stale
              else f"leased keys left: {stale}")
        productive = sum(x.get("step_s", 0.0) for x in lines)
        span = (lines[-1]["time"] - t0) if lines else 0.0
        worlds: list[int] = []
        for x in lines:
            if not worlds or worlds[-1] != x["world_size"]:
                worlds.append(x["world_size"])
        return Report(sc.name, all(v["ok"] for v in inv.values()), self.seed, records, inv,
                      round(productive / span, 4) if span > 0 else None, round(time.monotonic() - t_start, 1),
                      len(lines), worlds)


def _yaml(v) -> str:
    import yaml

    if isinstance(v, str):
        return v
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...").strip()


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{min(steps)}..{max(steps)} ({len(steps)} lines, {len(set(steps))} distinct)"


def _alive(pids: set[int]) -> list[int]:
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            continue
    return out


async def _leased_keys(endpoints: str, job_id: str) -> list[str]:
    from ftrt.store.etcd import EtcdStore

    store = EtcdStore(endpoints, timeout=3.0)
    try:
        kvs, _ = await store.get_prefix(f"/ftrt/{job_id}/")
        return [kv.key for kv in kvs if kv.lease]
    except Exception as exc:  # etcd unreachable at the end is itself a finding
        return [f"(could not read etcd: {type(exc).__name__})"]
    finally:
        await store.close()


def _verify_checkpoints(root: Path, damaged: set[int]) -> tuple[bool, str]:
    from ftrt.checkpoint import manifest as mf
    from ftrt.checkpoint.storage import parse_url, step_dir
    from ftrt.errors import CheckpointCorrupt

    if not root.exists():
        return False, f"no checkpoint folder at {root}"
    loc = parse_url(str(root))
    good, bad, unexpected = 0, [], []
    for folder in sorted(root.glob("step-*")):
        step = int(folder.name.split("-")[1])
        try:
            m = mf.read_manifest(loc, step_dir(step))
        except CheckpointCorrupt:
            continue  # not committed: does not exist for restore
        try:
            mf.verify_files(loc, step_dir(step), m, sorted(m.files))
            if step in damaged:
                unexpected.append(f"step {step} was damaged but verifies")
            good += 1
        except CheckpointCorrupt as exc:
            (bad if step in damaged else unexpected).append(f"step {step}: {exc}")
    if unexpected:
        return False, "; ".join(unexpected)
    return good > 0, f"{good} committed checkpoints verify" + (f"; {len(bad)} damaged on purpose fail as they must" if bad else "")
