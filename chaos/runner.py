"""Run one chaos scenario: start the cluster, train, inject the faults, check the invariants.

The job is the built-in GRPO trainer under ``ftrt launch`` on local nodes (one agent each, as
:class:`~ftrt.chaos.local.LocalNode`), on an etcd the runner starts (1 or 3 members). Faults
fire when rank 0's metrics reach ``at_step`` (or ``at_s`` after the first step), at once: a
fault whose step was reached is always injected. Recovery of a fault is the time from its
injection to the end of the step that closes the longest stall after it (rank 0's metrics; see
:func:`recovery_time`). Each fault records whether every live agent's spare workers were warm
when it came (each agent's own answer to ``Status``: :func:`~ftrt.chaos.local.spares_warm`), as
they are when faults come minutes apart in a long job; a *cold* fault (spares still warming after
a start or an earlier fault) is judged against ``expect.max_cold_recovery_s``.
At the end, the invariants of :mod:`ftrt.chaos.invariants` are judged on what the run left
(``final_step``, ``recovered``, ``checkpoints_verify``, ``ledger``, ``equivalence``,
``world_grows``, ``metrics_agree``, ``no_process_left``, ``no_stale_keys``). The runner reads every
agent's ``/metrics`` once a second (``Report.metrics``) for ``metrics_agree``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ftrt import progress
from ftrt.chaos import invariants
from ftrt.chaos.faults import Context, Injected, injector, preemption_path
from ftrt.chaos.invariants import CheckpointScan, recovery_limit
from ftrt.chaos.local import LocalNode, find_agents, read_jsonl, spares_warm
from ftrt.chaos.netns import NetLab, unavailable
from ftrt.chaos.proxy import TcpProxy
from ftrt.chaos.s3server import MotoS3
from ftrt.chaos.scenario import Fault, Scenario, storm_faults
from ftrt.store.etcd_server import free_port

SCRAPE_EVERY_S = 1.0
"""How often the runner reads each live agent's Prometheus metrics (their last reading is kept)."""
SILENCING = ("freeze_node", "partition_node")
"""Faults during which their target's agent cannot answer ``Status`` (frozen, or cut off from the
runner): whether its spares are warm is then what it last logged."""


@dataclass
class FaultRecord:
    kind: str
    target: str
    at: float  # seconds since the first step
    step: int  # rank 0's last logged step when injected
    detail: str = ""
    recovery_s: float | None = None
    ended_at: float | None = None
    duration_s: float | None = None
    spares_warm: bool = True  # every live agent's spare workers were warm when it was injected
    limit_s: float | None = None  # the recovery it was judged against (cold faults: the cold limit)


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
    skipped: str | None = None  # why the scenario could not run here (it then neither passed nor failed)
    metrics: dict[str, dict] = field(default_factory=dict)  # per node, its agent's last scrape (recovery, restarts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


_lines = read_jsonl


class ChaosRun:
    """One scenario run in ``work`` (its own etcd, nodes, checkpoints and metrics)."""

    def __init__(self, sc: Scenario, work: Path, seed: int = 0, log=print) -> None:
        self.sc, self.work, self.seed, self.log = sc, Path(work), seed, log
        self.rng = random.Random(seed)

    # -- cluster -----------------------------------------------------------------------------
    def _start_etcd(self, host: str):
        """The run's etcd and the access its clients need (None: plaintext without users)."""
        from ftrt.store.certs import tls_dir
        from ftrt.store.etcd_server import EtcdCluster, EtcdServer

        security = self.sc.cluster.etcd_security
        tls = tls_dir(self.work / "tls", hosts=(host,)) if security != "none" else None
        if self.sc.cluster.etcd_members == 3:
            etcd = EtcdCluster(3, host=host, unsafe_no_fsync=True, tls=tls).start()
            member = etcd.members[0]
        else:
            etcd = member = EtcdServer(name="chaos", host=host, unsafe_no_fsync=True, tls=tls,
                                       log_path=str(self.work / "etcd.log")).start()
        if security == "none":
            return etcd, None
        return etcd, member.secure_access(self.work, "chaos" if security == "tls+auth" else None)

    def _agent_tls(self):
        """The agents' mutual TLS for this run (one certificate for all, from the run's CA), or None."""
        if not self.sc.cluster.agent_tls:
            return None
        from ftrt.agents.peers.tls import AgentTls
        from ftrt.store.certs import tls_dir

        files = tls_dir(self.work / "tls")
        return AgentTls(str(files.server_cert), str(files.server_key), str(files.ca)).check()

    def _launch_args(self, endpoints: str, job_id: str, run: str, max_nodes: int, ckpt: dict,
                     access=None, agent_flags: list[str] | None = None) -> list[str]:
        c = self.sc.cluster
        grpo = {**self.sc.job.grpo, "steps": self.sc.steps, "progress": "none", "seed": self.seed,
                "metrics_path": str(self.work / f"{run}-metrics.jsonl"), **ckpt,
                **({"rollout.mode": "fleet"} if c.rollout_servers else {})}
        return ["--etcd", endpoints, *(access.flags() if access else ["--insecure-etcd"]), *(agent_flags or []),
                "--job-id", job_id, "--nnodes", f"{c.min_nodes or 1}:{max_nodes}",
                "--nproc-per-node", str(c.workers_per_node), "--lease-ttl", str(c.lease_ttl), "--recovery", c.recovery,
                "--hang-timeout", str(c.hang_timeout), "--first-round-wait", "5",
                *(["--mtbf", f"{mtbf:g}"] if (mtbf := self.sc.agent_mtbf()) is not None else []), "-m", "ftrt.grpo",
                *(f"{k}={_yaml(v)}" for k, v in grpo.items())]

    def faults(self) -> list[Fault]:
        """The scenario's faults plus, for a storm, the ones this run's seed draws."""
        storm = storm_faults(self.sc.storm, self.seed) if self.sc.storm is not None else []
        return [*self.sc.faults, *storm]

    # -- one job -----------------------------------------------------------------------------
    def _job(self, run: str, with_faults: bool, deadline: float) -> "JobResult":
        """Run the job once, with or without the faults, and check what needs the cluster still up."""
        sc = self.sc
        faults = self.faults() if with_faults else []
        max_nodes = sc.cluster.nodes + sum(f.kind == "add_node" for f in faults)
        res = JobResult()
        with contextlib.ExitStack() as stack:
            lab = stack.enter_context(NetLab(max_nodes, self.rng)) if sc.cluster.netns else None
            host = lab.host_ip if lab else "127.0.0.1"
            etcd, access = self._start_etcd(host)
            stack.callback(etcd.stop)
            endpoints = getattr(etcd, "urls" if access else "endpoints", None) or (etcd.url if access else etcd.endpoint)
            proxy, ckpt, verify_opts = None, {"checkpoint.url": str(self.work / f"{run}-ckpt")}, None
            if sc.cluster.storage == "s3":
                s3 = stack.enter_context(MotoS3())
                s3.create_bucket("chaos")
                proxy = stack.enter_context(TcpProxy("127.0.0.1", s3.port, listen_host=host))
                ckpt = {"checkpoint.url": f"s3://chaos/{run}-ckpt",
                        "checkpoint.storage_options": s3.storage_options(f"http://{proxy.endpoint}")}
                verify_opts = s3.storage_options()
            job_id = f"chaos-{run}"
            agent_tls = self._agent_tls()
            args = self._launch_args(endpoints, job_id, run, max_nodes, ckpt, access,
                                     agent_tls.flags() if agent_tls else [])
            metrics = self.work / f"{run}-metrics.jsonl"

            ports: dict[str, int] = {}

            def start_node(name: str) -> LocalNode:
                command = None
                i = args.index("-m")  # preempt_node's notice reaches the node through this file
                node_args = [*args[:i], "--preemption-file", str(preemption_path(self.work, job_id, name)),
                             "--preemption-poll", "0.2", *args[i:]]
                if lab is not None:
                    command = lab.wrap(Context.node_index(name), [sys.executable, "-m", "ftrt.cli.main", "launch",
                                                                  "--node-id", name, *node_args])
                else:  # each agent serves its metrics; the runner scrapes them (a restarted node keeps its port)
                    port = ports.setdefault(name, free_port())
                    node_args = [*node_args[:i], "--metrics-port", str(port), *node_args[i:]]
                node = LocalNode(self.work, name, node_args, command=command, env=NetLab.env() if lab else None)
                node.log_path = self.work / f"{run}-agent-{name}-{int(time.time() * 1000) % 100000}.log"
                return node.start()

            nodes: dict[str, LocalNode] = {}
            stack.callback(lambda: [node.cleanup() for node in nodes.values()])
            rollouts = None
            if sc.cluster.rollout_servers:
                from ftrt.chaos.faults.rollout import RolloutServers

                rollouts = RolloutServers(self.work, run, endpoints, job_id, host, sc.cluster.lease_ttl,
                                          access.flags() if access else [])
                stack.callback(rollouts.stop_all)
                for i in range(sc.cluster.rollout_servers):
                    rollouts.start(f"rollout{i}")
            for i in range(sc.cluster.nodes):
                nodes[f"node{i}"] = start_node(f"node{i}")
            ctx = Context(nodes, etcd, endpoints, job_id, self.work / f"{run}-ckpt", self.rng, start_node,
                          lab=lab, storage_proxy=proxy, etcd_access=access, metrics_ports=ports,
                          agent_tls=agent_tls, rollouts=rollouts)
            self._drive(ctx, faults, metrics, deadline, res)
            if rollouts is not None:  # the job is over: its servers go (each revokes its lease)
                rollouts.stop_all()
                res.pids.update(rollouts.pids)
                _wait_for_rollout_keys(endpoints, job_id, access, sc.cluster.lease_ttl + 2.0)
            res.codes = {n: node.proc.poll() for n, node in nodes.items() if n not in ctx.killed}
            res.stale = asyncio.run(_leased_keys(endpoints, job_id, access))
            res.ctx = ctx
            if with_faults:
                res.checkpoints = _scan_checkpoints(ckpt["checkpoint.url"], verify_opts, ctx.corrupted_steps)
        res.lines = _lines(metrics)
        t0 = res.t_first or (res.lines[0]["time"] if res.lines else time.time())
        res.t0 = t0
        done = sorted(invariants.injected(res.records), key=lambda r: r.at)
        step_ends = [x["time"] - t0 for x in res.lines]
        for i, rec in enumerate(done):
            rec.limit_s = recovery_limit(sc, rec.spares_warm)
            # a fault's window: while it lasts (not the rejoin after it), else the allowed recovery;
            # cut at the next fault
            limit = rec.at + (rec.duration_s or rec.limit_s)
            nxt = done[i + 1].at if i + 1 < len(done) else float("inf")
            rec.recovery_s = recovery_time(rec.at, step_ends, min(limit, nxt), next_fault=nxt < limit)
        return res

    def _drive(self, ctx: Context, faults: list[Fault], metrics: Path, deadline: float, res: "JobResult") -> None:
        """Watch the job, inject each fault when due and end it after its duration, until the job ends."""
        nodes = ctx.nodes
        pending = list(faults)
        ends: list[tuple[float, FaultRecord, Injected]] = []
        next_scrape = 0.0
        with progress.bar(self.sc.steps, f"chaos {self.sc.name}", "step") as shown:
            while time.monotonic() < deadline:
                lines = _lines(metrics)
                now = time.time()
                if lines and res.t_first is None:
                    res.t_first = lines[0]["time"] - lines[0].get("step_s", 0.0)
                since = now - (res.t_first or now)
                last_step = lines[-1]["step"] if lines else -1
                shown.set_postfix(faults=len(res.records), refresh=False)
                shown.update(max(0, last_step + 1 - shown.n))
                for node in nodes.values():
                    if node.alive():
                        res.pids.update(node.tree())
                # a fault after the last step would test nothing: it stays pending (reported as not injected)
                for f in list(pending) if last_step < self.sc.steps - 1 else []:
                    due = (f.at_step is not None and last_step >= f.at_step) or \
                          (f.at_s is not None and res.t_first is not None and since >= f.at_s)
                    if not due:
                        continue
                    pending.remove(f)
                    warm = self._spares_warm(nodes, {rec.target for _, rec, _ in ends if rec.kind in SILENCING})
                    # The fault's time is when it is injected: asking the agents whether their spares are
                    # warm and reading /proc take a while on a loaded machine, and the job trains meanwhile.
                    at = time.time() - (res.t_first or now)
                    try:
                        inj = injector(f.kind)(ctx, f)
                    except Exception as exc:  # noqa: BLE001 - a fault that cannot be injected is a finding
                        res.records.append(FaultRecord(f.kind, f.target, round(at, 3), last_step,
                                                       f"not injected: {exc}"))
                        self.log(f"[chaos] {f.kind} could not be injected: {exc}")
                        continue
                    rec = FaultRecord(f.kind, inj.target, round(at, 3), last_step, inj.detail, duration_s=f.duration_s,
                                      spares_warm=warm)
                    res.records.append(rec)
                    self.log(f"[chaos] {rec.at:7.2f} s  step {last_step:>4}  {f.kind} -> {inj.target}: {inj.detail}"
                             + ("" if warm else " (spares still warming: a cold fault)"))
                    if inj.end is not None:
                        ends.append((time.monotonic() + (f.duration_s or 0.0), rec, inj))
                        ctx.busy.add(inj.target)
                for item in list(ends):
                    if time.monotonic() >= item[0]:
                        ends.remove(item)
                        item[2].end()
                        ctx.busy.discard(item[2].target)
                        item[1].ended_at = round(time.time() - (res.t_first or time.time()), 3)
                        self.log(f"[chaos] {item[1].ended_at:7.2f} s  {item[1].kind} on {item[1].target} ended")
                if not any(n.alive() for n in nodes.values()):
                    break  # the job is over (or every node is dead)
                if time.monotonic() >= next_scrape:
                    next_scrape = time.monotonic() + SCRAPE_EVERY_S
                    for name, port in ctx.metrics_ports.items():
                        if nodes[name].alive() and (got := scrape_agent(port)) is not None:
                            res.scraped[name] = got
                find_agents(n for n in nodes.values() if n.alive())  # then a fault's warm check is one quick RPC each
                time.sleep(0.05)
        for _, rec, inj in ends:  # the run is over: end what is still going on (the dead stay dead)
            if rec.kind not in ("kill_node", "kill_rollout", "drain_node", "preempt_node"):
                inj.end()
                rec.ended_at = round(time.time() - (res.t_first or time.time()), 3)
        for f in pending:
            res.records.append(FaultRecord(f.kind, f.target, f.at_s if f.at_s is not None else -1.0, f.at_step or -1,
                                           "not injected: the job ended before it was due"))

    @staticmethod
    def _spares_warm(nodes: dict[str, LocalNode], silenced: set[str]) -> bool:
        """Every live agent's spares are warm: by its ``Status``, or for an agent a fault keeps from
        answering (``silenced``), by what it last logged."""
        alive = {name: n for name, n in nodes.items() if n.alive()}
        return spares_warm(n for name, n in alive.items() if name not in silenced) and all(
            n.spares_warm_in_log() for name, n in alive.items() if name in silenced)

    def run(self) -> Report:
        sc = self.sc
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        if sc.cluster.netns and (why := unavailable()) is not None:
            self.log(f"[chaos] {sc.name}: SKIPPED: {why}")
            return Report(sc.name, False, self.seed, skipped=why)
        t_start = time.monotonic()
        deadline = t_start + sc.timeout_s
        reference = None
        if sc.expect.equivalence == "exact":
            self.log(f"[chaos] {sc.name}: fault-free reference run first (equivalence: exact)")
            reference = self._job("reference", False, deadline).lines
        self.log(f"[chaos] {sc.name}: {sc.description}")
        job = self._job("run", True, deadline)
        lines = job.lines
        inv = invariants.judge(sc, job, reference, _alive(job.pids))
        productive = sum(x.get("step_s", 0.0) for x in lines)
        span = (lines[-1]["time"] - job.t0) if lines else 0.0
        return Report(sc.name, all(v["ok"] for v in inv.values()), self.seed, job.records, inv,
                      round(productive / span, 4) if span > 0 else None, round(time.monotonic() - t_start, 1),
                      len(lines), invariants.world_sizes(lines), metrics=job.scraped)


@dataclass
class JobResult:
    """What one run of the job left: metrics, faults, exit codes, processes, stale keys, checkpoints."""

    lines: list[dict] = field(default_factory=list)
    records: list[FaultRecord] = field(default_factory=list)
    codes: dict[str, int | None] = field(default_factory=dict)
    ctx: Context | None = None
    pids: set[int] = field(default_factory=set)
    stale: list[str] = field(default_factory=list)
    t_first: float | None = None
    t0: float = 0.0
    checkpoints: CheckpointScan | None = None  # what storage held at the end (runs with faults)
    scraped: dict[str, dict] = field(default_factory=dict)  # node -> its agent's newest scrape


def recovery_time(at: float, step_ends: list[float], window_end: float, next_fault: bool = False,
                  lead: float = 1.0) -> float | None:
    """Seconds from a fault at ``at`` to the end of the longest stall it caused.

    ``step_ends`` are the times committed steps ended (sorted). A stall is a gap between ``at``
    (or a step end) and the next step end; the fault's is the longest one that starts within
    ``lead`` seconds of ``at`` (a fault stalls training at once or not at all; a jitter seconds
    later is not its doing), among the ends up to ``window_end`` plus the first one after it (a
    stall still open at the end of the window is this fault's) unless ``next_fault`` says the
    window ends because another fault came then. Taking the longest such gap, not the first step
    that ended, keeps a step the victim had already contributed to from passing for a recovery (a
    frozen worker can have sent its part of the next step before it stopped). None: no step ended
    after the fault.
    """
    after = [t for t in step_ends if t > at]
    if not after:
        return None
    inside = [t for t in after if t <= window_end]
    ends = inside if inside and next_fault else inside + after[len(inside):len(inside) + 1]
    prev, best, closing = at, -1.0, ends[0]
    for t in ends:
        if prev > at + lead:
            break
        if t - prev > best:
            best, closing = t - prev, t
        prev = t
    return round(closing - at, 3)


def _yaml(v) -> str:
    import yaml

    if isinstance(v, str):
        return v
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...").strip()


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


async def _leased_keys(endpoints: str, job_id: str, access=None) -> list[str]:
    from ftrt.store.access import EtcdAccess
    from ftrt.store.etcd import EtcdStore

    store = EtcdStore(endpoints, timeout=3.0, access=access or EtcdAccess())
    try:
        kvs, _ = await store.get_prefix(f"/ftrt/{job_id}/")
        return [kv.key for kv in kvs if kv.lease]
    except Exception as exc:  # etcd unreachable at the end is itself a finding
        return [f"(could not read etcd: {type(exc).__name__})"]
    finally:
        await store.close()


def _wait_for_rollout_keys(endpoints: str, job_id: str, access, timeout: float) -> None:
    """Give the leases of killed rollout servers up to ``timeout`` to run out (their keys would
    otherwise count as stale: a SIGKILLed process cannot revoke its lease)."""
    from ftrt.jobkeys import JobKeys

    prefix = JobKeys(job_id).rollout_servers
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not [k for k in asyncio.run(_leased_keys(endpoints, job_id, access)) if k.startswith(prefix)]:
            return
        time.sleep(0.25)


def _scan_checkpoints(url: str, storage_options: dict | None, damaged: set[int]) -> CheckpointScan:
    """Which committed checkpoints ``url`` holds and whether each one's files verify."""
    from ftrt.checkpoint import manifest as mf
    from ftrt.checkpoint.storage import list_steps, parse_url, step_dir
    from ftrt.errors import CheckpointCorrupt

    loc = parse_url(url, storage_options)
    try:
        steps = list_steps(loc)
    except Exception as exc:  # noqa: BLE001 - unreadable storage at the end is the finding
        return CheckpointScan(url, damaged=frozenset(damaged), listing_error=str(exc))
    verified: dict[int, str | None] = {}
    for step in steps:
        try:
            mf.read_manifest(loc, step_dir(step))
        except CheckpointCorrupt:
            continue  # not committed: does not exist for restore
        try:
            mf.verify_step(loc, step_dir(step))
            verified[step] = None
        except CheckpointCorrupt as exc:
            verified[step] = str(exc)
    return CheckpointScan(url, verified, frozenset(damaged))


def scrape_agent(port: int) -> dict | None:
    """The recovery histogram's sum and count and the restarts by cause, from one agent's
    ``/metrics`` (None if it does not answer in time)."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out: dict = {"recovery_sum_s": 0.0, "recovery_count": 0, "restarts": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ftrt_recovery_seconds_sum":
                out["recovery_sum_s"] = round(s.value, 4)
            elif s.name == "ftrt_recovery_seconds_count":
                out["recovery_count"] = int(s.value)
            elif s.name == "ftrt_restarts_total" and s.value:
                out["restarts"][s.labels["reason"]] = int(s.value)
    return out
