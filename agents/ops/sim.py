"""Simulation mode: many agents' membership and rendezvous in one process, with stand-in workers.

For measuring the rendezvous at hundreds of nodes on one machine. A :class:`SimNode` runs the
real agent stack that decides rounds: its own etcd client, a :class:`~ftrt.store.concurrency.Session`
(lease and keep-alive), :func:`~ftrt.agents.rendezvous.membership.register`, a
:class:`~ftrt.agents.rendezvous.rendezvous.Rendezvous` (watch, pure decision, fenced compare-and-swap round
writes). What it leaves out is everything per machine: worker processes (a :class:`StandInWorkers`
only records the ranks a round gives the node), the gRPC service and peer monitoring. A node's
death is simulated the way a peer's agent reacts to one, by revoking its lease.

Run as ``python -m ftrt.agents.ops.sim --etcd HOST:PORT --job-id J --nodes 0:64 --max-nodes 256``: it
connects every node's client, prints ``{"event": "connected"}`` and then reads commands on
stdin, one per line: ``join`` (every node registers at once and runs its rendezvous), ``kill
NODE_ID`` (revoke that node's lease and stop it), ``kill-decider`` (the same for the job's decider,
if it is one of this process's nodes), ``quit``. Events go to stdout as JSON lines:
``registered`` (a node's key is written) and ``round`` (a node saw a new active round; with the
round number, world size and the node's ranks). Times are ``time.time()``, comparable across the
processes of one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

from ftrt.agents.rendezvous.decide import RendezvousConfig
from ftrt.jobkeys import JobKeys
from ftrt.agents.rendezvous.membership import register
from ftrt.records import NodeRecord
from ftrt.roster import LocalRound
from ftrt.agents.rendezvous.rendezvous import Rendezvous
from ftrt.store.concurrency import Session
from ftrt.store.etcd import EtcdStore


class StandInWorkers:
    """What a node's worker pool would start in a round: only the global ranks, recorded."""

    def __init__(self) -> None:
        self.ranks: list[int] = []
        self.round = 0

    def start(self, rnd: LocalRound, node_id: str) -> list[int]:
        me = rnd.member(node_id)
        first = rnd.rank_offset(node_id) if me is not None else 0
        self.ranks, self.round = list(range(first, first + (me.nproc if me else 0))), rnd.round
        return self.ranks


class SimNode:
    """One simulated agent: lease, registration and rendezvous on its own etcd client."""

    def __init__(self, endpoints: str, job_id: str, node_id: str, cfg: RendezvousConfig, *,
                 lease_ttl: float = 5.0, emit=None) -> None:
        self.store = EtcdStore(endpoints, timeout=10.0, attempt_timeout=5.0)
        self.keys = JobKeys(job_id)
        self.node_id = node_id
        self.cfg = cfg
        self.lease_ttl = lease_ttl
        self.emit = emit or (lambda event: None)
        self.workers = StandInWorkers()
        self.session: Session | None = None
        self.rdzv: Rendezvous | None = None
        self.rounds: dict[int, float] = {}
        """Round number -> when this node first saw it active."""

    async def connect(self) -> None:
        await self.store.get(self.keys.root)  # opens the channel

    async def join(self) -> None:
        self.session = await Session(self.store, self.lease_ttl).start()
        rec = NodeRecord(node_id=self.node_id, incarnation=uuid.uuid4().hex[:12], host="sim",
                         agent_addr="sim:0", nproc=1, ready=True, pid=os.getpid(), started=time.time())
        await register(self.store, self.keys, rec, self.session.lease_id)
        self.emit({"event": "registered", "node": self.node_id, "t": time.time()})
        self.rdzv = Rendezvous(self.store, self.keys, self.node_id, self.cfg, on_change=self._changed,
                               registration=lambda: (self.session.lease_id, rec.incarnation))
        await self.rdzv.start()
        self._changed()

    def _changed(self) -> None:
        rnd = self.rdzv.view.round if self.rdzv is not None else None
        if rnd is None or not rnd.active or rnd.round in self.rounds:
            return
        self.rounds[rnd.round] = time.time()
        ranks = self.workers.start(rnd, self.node_id)
        self.emit({"event": "round", "node": self.node_id, "round": rnd.round, "world": rnd.world_size,
                   "ranks": ranks, "t": self.rounds[rnd.round]})

    async def die(self) -> None:
        """Leave as a dead node does once a peer notices: the lease is revoked, nothing else is said."""
        if self.rdzv is not None:
            await self.rdzv.close()
        if self.session is not None:
            await self.session.close()
        await self.store.close()


async def _main(args: argparse.Namespace) -> int:
    lo, _, hi = args.nodes.partition(":")
    cfg = RendezvousConfig(min_nodes=args.min_nodes, max_nodes=args.max_nodes, settle_s=args.settle,
                           join_settle_s=args.join_settle, first_round_wait_s=args.first_round_wait)
    out = sys.stdout

    def emit(event: dict) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    nodes = {f"sim{i}": SimNode(args.etcd, args.job_id, f"sim{i}", cfg, lease_ttl=args.lease_ttl, emit=emit)
             for i in range(int(lo), int(hi))}
    await asyncio.gather(*(n.connect() for n in nodes.values()))
    emit({"event": "connected", "nodes": len(nodes), "t": time.time()})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    alive = dict(nodes)
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "quit":
            break
        cmd, _, arg = line.partition(" ")
        if cmd == "join":
            await asyncio.gather(*(n.join() for n in nodes.values()))
        elif cmd == "kill" and arg in alive:
            t = time.time()
            await alive.pop(arg).die()
            emit({"event": "killed", "node": arg, "t": t})
        elif cmd == "kill-decider":
            for node_id, node in list(alive.items()):
                if node.rdzv is not None and node.rdzv.deciding:
                    t = time.time()
                    await alive.pop(node_id).die()
                    emit({"event": "killed", "node": node_id, "decider": True, "t": t})
    await asyncio.gather(*(n.die() for n in alive.values()), return_exceptions=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftrt.agents.ops.sim", description=__doc__.splitlines()[0])
    p.add_argument("--etcd", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--nodes", required=True, help="LO:HI: simulate nodes simLO..sim(HI-1)")
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--max-nodes", type=int, required=True)
    p.add_argument("--lease-ttl", type=float, default=5.0)
    p.add_argument("--settle", type=float, default=0.05, help="as ftrt launch --settle")
    p.add_argument("--join-settle", type=float, default=0.2, help="as ftrt launch --join-settle")
    p.add_argument("--first-round-wait", type=float, default=0.5, help="as ftrt launch --first-round-wait")
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
