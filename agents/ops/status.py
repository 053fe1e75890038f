"""``ftrt status``: who is in a job's world, which round, restarts, workers' steps, recent events.

It reads the job's keys in etcd and asks each member's agent (gRPC, short deadline) for its
workers. ``--json`` prints the same as one JSON object for scripts. ``--watch`` then follows the
job live through an etcd watch on its keys: each event and each new round as it is written
(JSON lines with ``--json``), until the job ends or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

from ftrt.helptext import help_summary
from ftrt.agents.ops.events import recent_events
from ftrt.auth import JobToken, read_token
from ftrt.errors import FtrtError, StoreUnavailable
from ftrt.jobkeys import JobKeys, check_id
from ftrt.records import DeciderRecord, JobState, NodeRecord, RoundRecord, decode
from ftrt.roster import load_round
from ftrt.agents.peers import tls as tls_flags
from ftrt.agents.peers.tls import PLAINTEXT, AgentTls
from ftrt.store import access as etcd_access
from ftrt.store.access import EtcdAccess
from ftrt.store.api import Get
from ftrt.store.etcd import EtcdStore, unreachable


UNKNOWN_JOB = "unknown job (nothing of it in etcd)"
"""The state of a job etcd knows nothing of: no agent, no round, no rollout server, no event, no
checkpoint pointer, no token."""


async def collect_status(endpoints: str, job_id: str, events: int = 10, timeout: float = 3.0,
                         access: EtcdAccess = EtcdAccess(), agent_tls: AgentTls = PLAINTEXT) -> dict:
    """Gather a job's status as a plain dict."""
    keys = JobKeys(job_id)
    store = EtcdStore(endpoints, timeout=timeout, access=access)
    try:
        try:
            res = await store.txn([], [Get(keys.nodes, prefix=True), Get(keys.rdzv, prefix=True)])
        except StoreUnavailable as exc:
            raise unreachable(endpoints, timeout) from exc
        nodes: dict[str, NodeRecord] = {}
        rnd: RoundRecord | None = None
        job: JobState | None = None
        decider: str | None = None
        for kv in res.results[0]:
            rec = decode(NodeRecord, kv.value)
            nodes[rec.node_id] = rec
        for kv in res.results[1]:
            if kv.key == keys.round:
                local = await load_round(store, keys, kv.value)
                rnd = local.record() if local is not None else None
            elif kv.key == keys.state:
                job = decode(JobState, kv.value)
            elif kv.key == keys.decider:
                decider = decode(DeciderRecord, kv.value).node_id
        log = await recent_events(store, keys, events)
        ptr_kv, _ = await store.get(keys.ckpt + "latest")
        latest = json.loads(ptr_kv.value) if ptr_kv else None
        rollout = await _rollout_servers(store, keys)
        token = await read_token(store, keys, timeout=timeout)
    finally:
        await store.close()
    members = [n for n in nodes.values() if rnd and rnd.member(n.node_id)]
    workers, refused = await _agent_workers(members, token, agent_tls) if token is not None else ({
        n.node_id: [{"error": "the job has no token in etcd yet: its agents cannot be asked"}] for n in members}, {})
    if job is not None:
        state = job.state
    elif rnd is None:
        # no agent, no round: a job only if something else of it is in etcd (a trainer run without
        # ftrt launch that serves a rollout fleet, its events, its checkpoints' pointer, its token)
        state = "waiting for nodes" if nodes or rollout or log or latest or token is not None else UNKNOWN_JOB
    else:
        state = "running" if rnd.active else "waiting for nodes (below minimum)"
    return {
        "job_id": job_id,
        "state": state,
        "job": dataclasses.asdict(job) if job else None,
        "round": dataclasses.asdict(rnd) if rnd else None,
        "world_size": rnd.world_size if rnd else 0,
        "decider": decider,
        "nodes": {nid: dataclasses.asdict(n) for nid, n in sorted(nodes.items())},
        "workers": workers,
        "replicas_refused": refused,
        "latest_checkpoint": latest,
        "rollout_servers": rollout,
        "events": log,
    }


async def _rollout_servers(store: EtcdStore, keys: JobKeys) -> list[dict]:
    """The job's registered rollout servers (``ftrt rollout serve``) and the weight versions they hold."""
    from ftrt.rollout.records import ServerRecord

    kvs, _ = await store.get_prefix(keys.rollout_servers)
    out = []
    for kv in kvs:
        try:
            rec = ServerRecord.decode(kv.value)
        except (ValueError, KeyError, TypeError, FtrtError):
            out.append({"server_id": kv.key.rsplit("/", 1)[-1], "error": "malformed record"})
            continue
        out.append({"server_id": rec.server_id, "addr": rec.addr, "engine": rec.engine, "pid": rec.pid,
                    "versions": sorted(rec.versions)})
    return out


async def _agent_workers(nodes: list[NodeRecord], token: JobToken,
                         tls: AgentTls) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """Per node, its workers as its agent tells them, and how many memory replicas it refused."""
    from ftrt.agents.peers.service import status

    async def one(node: NodeRecord):
        try:
            resp = await status(node.agent_addr, token, timeout=1.0, tls=tls)
        except Exception as exc:  # an unreachable agent is part of the answer, not an error
            return node.node_id, [{"error": f"agent unreachable: {type(exc).__name__}"}], 0
        return node.node_id, [
            {"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid, "state": w.state,
             "step": w.step, "heartbeat_age_s": round(w.last_heartbeat_age_s, 2), "since_round": w.since_round}
            for w in resp.workers
        ], resp.replicas_refused

    answers = await asyncio.gather(*(one(n) for n in nodes))
    return {n: w for n, w, _ in answers}, {n: r for n, _, r in answers if r}


def render(st: dict) -> str:
    """Human-readable status."""
    lines = [f"job {st['job_id']}: {st['state']}"]
    rnd = st["round"]
    if st["job"]:
        lines.append(f"  reason: {st['job']['reason']}")
    if rnd:
        created = time.strftime("%H:%M:%S", time.localtime(rnd["created"])) if rnd["created"] else "?"
        lines.append(
            f"round {rnd['round']}: world size {st['world_size']}, {len(rnd['members'])} node(s), "
            f"failure restarts {rnd['restart_count']}; written {created} by {rnd['writer'] or '?'}: {rnd['reason']}"
        )
        lines.append(f"decider: {st['decider'] or 'none (being elected)'}")
        lines.append("members (rank order):")
        offset = 0
        for i, m in enumerate(rnd["members"]):
            node = st["nodes"].get(m["node_id"])
            where = f"agent {node['agent_addr']} pid {node['pid']}" if node else "GONE"
            ranks = f"ranks {offset}-{offset + m['nproc'] - 1}"
            offset += m["nproc"]
            lines.append(f"  {i:>3}  {m['node_id']:<20} {ranks:<14} {where}")
            for w in st["workers"].get(m["node_id"], []):
                if "error" in w:
                    lines.append(f"         {w['error']}")
                elif w["rank"] >= 0:
                    kept = (f", kept in place since round {w['since_round']}"
                            if 0 < w.get("since_round", 0) < rnd["round"] else "")
                    lines.append(
                        f"         rank {w['rank']}: pid {w['pid']} {w['state']}, step {w['step']}, "
                        f"last heartbeat {w['heartbeat_age_s']} s ago{kept}"
                    )
            if st.get("replicas_refused", {}).get(m["node_id"]):
                lines.append(f"         refused {st['replicas_refused'][m['node_id']]} memory replica(s) (its log says "
                             "why: not what their owner claimed, an old copy, or the claims unreadable)")
    ck = st.get("latest_checkpoint")
    if ck:
        when = time.strftime("%H:%M:%S", time.localtime(ck["time"]))
        lines.append(f"latest checkpoint: step {ck['step']} at {when} (round {ck['round']}) in {ck['url']}")
    if st.get("rollout_servers"):
        lines.append("rollout servers:")
        for r in st["rollout_servers"]:
            if "error" in r:
                lines.append(f"       {r['server_id']:<20} {r['error']}")
                continue
            held = ", ".join(map(str, r["versions"])) or "none yet"
            lines.append(f"       {r['server_id']:<20} {r['engine']} at {r['addr']} pid {r['pid']}, "
                         f"weight versions {held}")
    members = {m["node_id"] for m in rnd["members"]} if rnd else set()
    others = [n for nid, n in st["nodes"].items() if nid not in members]
    if others:
        lines.append("other nodes:")
        for n in others:
            what = "finished" if n["done_round"] else ("ready (spare)" if n["ready"] else "warming up")
            lines.append(f"       {n['node_id']:<20} {what}, agent {n['agent_addr']}")
    if st["events"]:
        lines.append("recent events:")
        lines.extend(render_event(e) for e in st["events"])
    return "\n".join(lines)


def render_event(e: dict) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(e["time"])) + f".{int(e['time'] % 1 * 1000):03d}"
    return f"  {t} {e['node']:<12} {e['kind']:<14} {e['message']}"


async def watch_status(endpoints: str, job_id: str, *, access: EtcdAccess = EtcdAccess(), events: int = 10,
                       as_json: bool = False, out=print, agent_tls: AgentTls = PLAINTEXT) -> str:
    """Print the status, then every event and round change as etcd records it, until the job
    succeeds or fails; return its final state."""
    keys = JobKeys(job_id)
    store = EtcdStore(endpoints, timeout=3.0, access=access)
    try:
        _, revision = await store.get(keys.round)
        st = await collect_status(endpoints, job_id, events, access=access, agent_tls=agent_tls)
        out(json.dumps(st) if as_json else render(st))
        if st["job"]:
            return st["job"]["state"]
        seen = {(e["time"], e["node"]) for e in st["events"]}
        async for batch in store.watch_prefix(keys.root, revision + 1):
            for ev in batch:
                if ev.kind != "put":
                    continue
                if ev.key.startswith(keys.events):
                    try:
                        e = json.loads(ev.value)
                        if (e["time"], e["node"]) in seen:
                            continue
                        out(json.dumps({"event": e}) if as_json else render_event(e))
                    except (ValueError, KeyError, TypeError):
                        continue
                elif ev.key == keys.round:
                    local = await load_round(store, keys, ev.value)
                    if local is None:
                        continue
                    rnd = local.record()
                    out(json.dumps({"round": dataclasses.asdict(rnd)}) if as_json else
                        f"round {rnd.round}: world size {rnd.world_size}, {len(rnd.members)} node(s) "
                        f"({', '.join(rnd.node_ids)}): {rnd.reason}")
                elif ev.key == keys.state:
                    job = decode(JobState, ev.value)
                    out(json.dumps({"job": dataclasses.asdict(job)}) if as_json else
                        f"job {job_id}: {job.state}: {job.reason}")
                    return job.state
        return "unknown"
    finally:
        await store.close()


def status_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ftrt status", description=help_summary(__doc__))
    p.add_argument("--etcd", "--rdzv-endpoint", dest="etcd", required=True, help="etcd endpoints HOST:PORT[,...]")
    p.add_argument("--job-id", "--rdzv-id", dest="job_id", required=True, help="the job's id")
    p.add_argument("--events", type=int, default=10, help="how many recent events to show (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--watch", action="store_true",
                   help="then follow the job live: each event and round change, until it ends (Ctrl-C stops)")
    etcd_access.add_arguments(p.add_argument_group("etcd security (TLS and auth)"))
    tls_flags.add_arguments(p.add_argument_group("agents' mutual TLS (to ask them for their workers)"))
    args = p.parse_args(argv)
    check_id("job id", args.job_id)
    access = etcd_access.from_args(args)
    tls = tls_flags.from_args(args)
    if args.watch:
        try:
            asyncio.run(watch_status(args.etcd, args.job_id, access=access, events=args.events, as_json=args.json,
                                     out=lambda line: print(line, flush=True), agent_tls=tls))
        except KeyboardInterrupt:
            pass
        return 0
    st = asyncio.run(collect_status(args.etcd, args.job_id, args.events, access=access, agent_tls=tls))
    if st["state"] == UNKNOWN_JOB:
        raise FtrtError(f"No job {args.job_id!r} in etcd at {args.etcd}: no agent has registered in it and no round "
                        "was written. Check --job-id (the id given to ftrt launch) and --etcd.")
    print(json.dumps(st, indent=2) if args.json else render(st))
    return 0
