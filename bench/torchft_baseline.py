"""torchft as a baseline system of the recovery bench: a cluster with the surface of ``bench.recovery.Cluster``.

torchft (pip ``torchft``) keeps training through faults without restarting the survivors: each
replica group asks a central *lighthouse* for a quorum every step, averages its gradients over that
quorum, and commits the step only if the reduction went through. A (re)joining group heals from a
live peer's state in its first quorum. Here each simulated node is one replica group of one process
(:mod:`bench.torchft_worker`, the ``ddp_steps.py --plain`` workload) under its own single-node
``torchrun``, which restarts a crashed worker; every group writes its steps to one
:class:`~ftrt.chaos.local.StepLog`, so the bench measures torchft as it measures ftrt and torchrun.

torchft runs with its best settings for recovery, on loopback only:

- the lighthouse's ``--heartbeat_timeout_ms`` is 500 (torchft's default is 5000). It bounds the
  stall after a kill: a killed peer closes its sockets, so the survivors' step fails at once, but
  the lighthouse issues the smaller quorum only once the dead group's last heartbeat is older than
  this timeout. Each manager heartbeats every 100 ms, so 500 ms is five missed heartbeats; lower
  would risk dropping a live group that the load on the machine delays.
- ``--quorum_tick_ms 100`` (its default), ``--min_replicas 1`` (a lone survivor trains on), and
  ``--join_timeout_ms 10000``: how long a quorum waits for groups that heartbeat but have not asked
  to join; it must exceed the heartbeat timeout, or a quorum could form before the dead group
  counts as dead.
- the workers' gloo timeout is torchft's ``train_ddp.py`` value, 5 s (:data:`bench.torchft_worker.PG_TIMEOUT`):
  it bounds the stall on a frozen peer, whose sockets stay open.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from ftrt.chaos.local import LocalNode, StepLog, wait_until

from ftrt.store.etcd_server import free_port

WORKER = Path(__file__).resolve().parent / "torchft_worker.py"
GRPO_WORKER = Path(__file__).resolve().parent / "torchft_grpo_worker.py"
"""The goodput bench's job (:mod:`bench.torchft_grpo_worker`), given the GRPO config as ``KEY=VALUE``."""
LOOPBACK = "127.0.0.1"
LIGHTHOUSE_READY_S = 10.0
"""How long the lighthouse may take to listen after its start."""


class TorchftCluster:
    """Replica groups of torchft sharing a lighthouse and a step log, one per simulated node."""

    system = "torchft"

    def __init__(self, work: Path, *, nnodes: str = "2:3", workload: str = "plain",
                 script_extra: tuple[str, ...] = (), heartbeat_timeout_ms: int = 500):
        self.work = work
        self.workload = workload
        self.script_extra = script_extra
        self.log = StepLog(work / "steps.jsonl")
        self.marker = work / "fault.json"
        self.nodes: dict[str, LocalNode] = {}
        lighthouse_port = free_port()
        self.env = {
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(WORKER.parent.parent),  # the GRPO worker imports bench's modules
            "GLOO_SOCKET_IFNAME": "lo",  # gloo would otherwise pick the interface of the host name
            "NUM_REPLICA_GROUPS": nnodes.split(":")[-1],
            "TORCHFT_LIGHTHOUSE": f"http://{LOOPBACK}:{lighthouse_port}",
        }
        self._lighthouse = Lighthouse(work / "lighthouse.log", lighthouse_port, heartbeat_timeout_ms)

    def script_args(self, steps: int) -> list[str]:
        return [
            str(WORKER), "--steps", str(steps), "--step-time", "0.05", "--progress", str(self.log.path),
            "--all-ranks", "--ckpt", str(self.work / "ckpt.json"), "--fault-marker", str(self.marker),
            "--fail-when", str(self.work / "arm"), "--fail-rank", "1",
            *(["--plain"] if self.workload == "plain" else []), *self.script_extra,
        ]

    def add(self, node_id: str, script: list[str]) -> LocalNode:
        """Start node ``n<i>`` as replica group ``i`` under a torchrun of its own (its own
        rendezvous port, so a restarted group starts afresh)."""
        group = int(node_id.lstrip("n"))
        node = LocalNode(self.work, node_id, [], env={**self.env, "REPLICA_GROUP_ID": str(group)}, command=[
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{free_port()}",
            # The workers' MASTER_ADDR, which torchft's quorum hands to peers: loopback, not the host name.
            "--local-addr", LOOPBACK,
            "--max-restarts", "10", "--monitor-interval", "0.1", *script,
        ])
        self.nodes[node_id] = node.start()
        return node

    def spares_warm(self) -> bool:
        """torchft keeps no spare workers."""
        return True

    def node_of_rank(self, rank: int, since: float = 0.0) -> str:
        """The node whose process tree holds the worker that last logged ``rank`` (a replica group id)."""
        pid = [x["pid"] for x in self.log.after(since) if x["rank"] == rank][-1]
        for nid, node in self.nodes.items():
            if pid in node.tree():
                return nid
        raise RuntimeError(f"No node holds pid {pid}, which logged rank {rank}.")

    def victim(self, rank0: bool) -> str:
        """The node to fault: replica group 0's, or another. Group 0 sorts first among the replica
        ids, so while it lives its torchrun store hosts the quorum's process-group rendezvous."""
        holder = self.node_of_rank(0, time.time() - 1)
        if rank0:
            return holder
        return next(n for n in ("n1", "n2", "n0") if n != holder)

    def close(self) -> None:
        for node in self.nodes.values():
            node.cleanup()
        self._lighthouse.stop()


class Lighthouse:
    """A ``torchft_lighthouse`` process on a loopback port, started at construction and listening
    when the constructor returns."""

    def __init__(self, log_path: Path, port: int, heartbeat_timeout_ms: int):
        self.port = port
        self._log = open(log_path, "ab")  # noqa: SIM115 - the lighthouse writes to it until stop()
        self.proc = subprocess.Popen([
            str(Path(sys.executable).with_name("torchft_lighthouse")), "--bind", f"{LOOPBACK}:{port}",
            "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
        ], stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(self._listening, LIGHTHOUSE_READY_S, f"the torchft lighthouse to listen on port {port}")
        except Exception:
            self.stop()
            raise

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"The torchft lighthouse exited with code {self.proc.returncode}; "
                               f"its log is {self._log.name}.")
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()
