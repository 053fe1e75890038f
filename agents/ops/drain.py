"""``ftrt drain``: ask one node's agent to leave the job gracefully, from anywhere etcd is reachable.

The command writes a :class:`~ftrt.records.DrainRequest` for the node's current incarnation under
``rdzv/drain/<node>`` (:class:`~ftrt.jobkeys.JobKeys`); the node's agent sees it in the watch it
already has and drains exactly as on SIGTERM (:meth:`ftrt.agents.agent.Agent._begin_drain`): the
job ends the round at a step boundary without it and goes on. A later incarnation of the same node
(a restart) ignores the request. With ``--wait`` the command returns once the node has left.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from ftrt.helptext import help_summary
from ftrt.errors import FtrtError, StoreUnavailable
from ftrt.jobkeys import JobKeys, check_id
from ftrt.records import DrainRequest, NodeRecord, decode, encode
from ftrt.store import access as etcd_access
from ftrt.store.access import EtcdAccess
from ftrt.store.etcd import EtcdStore, unreachable


async def request_drain(endpoints: str, job_id: str, node_id: str, *, reason: str = "",
                        access: EtcdAccess = EtcdAccess(), wait: float = 0.0, timeout: float = 3.0) -> str:
    """Ask ``node_id`` to drain; with ``wait`` > 0, wait that long for it to leave. Returns what
    happened, as a sentence."""
    keys = JobKeys(job_id)
    store = EtcdStore(endpoints, timeout=timeout, access=access)
    try:
        try:
            kv, _ = await store.get(keys.node(node_id))
        except StoreUnavailable as exc:
            raise unreachable(endpoints, timeout) from exc
        if kv is None:
            raise FtrtError(f"No node {node_id!r} is registered in job {job_id!r}: `ftrt status --etcd {endpoints} "
                            f"--job-id {job_id}` lists its nodes.")
        node = decode(NodeRecord, kv.value, lease=kv.lease)
        req = DrainRequest(node_id=node_id, incarnation=node.incarnation, reason=reason, time=time.time())
        await store.put(keys.drain(node_id), encode(req), lease=node.lease)  # goes when the node does
        if wait <= 0:
            return f"asked {node_id} (incarnation {node.incarnation}) to drain"
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            kv, _ = await store.get(keys.node(node_id))
            if kv is None or decode(NodeRecord, kv.value).incarnation != node.incarnation:
                return f"{node_id} left the job {time.monotonic() - t0:.1f} s after the request (its log says how)"
            await asyncio.sleep(0.2)
        raise FtrtError(f"{node_id} was asked to drain but is still registered after {wait:g} s: its agent may be "
                        "an older ftrt, or busy past its --drain-timeout; `ftrt status` shows the job.")
    finally:
        await store.close()


def drain_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ftrt drain", description=help_summary(__doc__))
    p.add_argument("node", help="the node id to drain (as ftrt status lists it)")
    p.add_argument("--etcd", "--rdzv-endpoint", dest="etcd", required=True, help="etcd endpoints HOST:PORT[,...]")
    p.add_argument("--job-id", "--rdzv-id", dest="job_id", required=True, help="the job's id")
    p.add_argument("--reason", default="", help="said in the node's log and the job's events")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the node to leave (default: return at once)")
    etcd_access.add_arguments(p.add_argument_group("etcd security (TLS and auth)"))
    args = p.parse_args(argv)
    check_id("job id", args.job_id)
    check_id("node id", args.node)
    print(asyncio.run(request_drain(args.etcd, args.job_id, args.node, reason=args.reason,
                                    access=etcd_access.from_args(args), wait=args.wait)))
    return 0
