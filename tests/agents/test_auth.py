"""Agent RPCs that change state or tell about the job need the job's token: real etcd, real agents,
a rogue gRPC client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest

from ftrt.auth import GUARDED, OPEN, JobToken, job_token
from ftrt.jobkeys import JobKeys
from ftrt.store.etcd import EtcdStore
from ftrt.v1 import agent_pb2, agent_pb2_grpc
from ftrt.agents.peers import service
from tests.agents.harness import FAST_WARM, Node, kill_at_rest, wait_until
from tests.agents.test_agent_tls import job_token_of
from tests.agents.test_claims import forge_replica_in_job

WORKER = Path(__file__).parents[1] / "checkpoint" / "tier_worker.py"


def test_every_agent_rpc_is_either_open_to_probes_or_needs_the_token():
    methods = {m.name for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods}
    assert methods == OPEN | GUARDED and not OPEN & GUARDED, methods  # a new RPC must be classified
    assert OPEN == {"Health"}, OPEN


def test_the_first_agent_creates_the_jobs_token_and_every_other_reads_the_same(etcd_endpoint, job_id):
    async def main():
        stores = [EtcdStore(etcd_endpoint, timeout=3.0) for _ in range(4)]
        try:
            return await asyncio.gather(*(job_token(s, JobKeys(job_id)) for s in stores))
        finally:
            for s in stores:
                await s.close()

    tokens = asyncio.run(main())
    assert len({t.value for t in tokens}) == 1 and len(tokens[0].value) == 64
    t = tokens[0]
    assert t.allows(t.metadata())
    assert not t.allows(()) and not t.allows((("authorization", "Bearer " + "0" * 64),))
    assert not t.allows(JobToken("x" * 64).metadata())


def rogue_calls(addr: str) -> dict[str, grpc.StatusCode]:
    """Every RPC that needs the token, without it and with a made-up one; the status of each."""
    index = {"step": 1, "round": 1, "rank": 0, "world": 1, "slot": 0, "size": 64, "entries": [],
             "skeleton": {"dict": []}}
    replica = agent_pb2.ReplicaChunk(source_node="rogue", rank=0, step=1, index_json=json.dumps(index),
                                     data=b"\xff" * 64)

    async def main():
        out = {}
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            calls = {
                "PutReplica": lambda md: stub.PutReplica(iter([replica]), metadata=md, timeout=5),
                "Status": lambda md: stub.Status(agent_pb2.StatusRequest(), metadata=md, timeout=5),
                "Liveness": lambda md: anext(aiter(stub.Liveness(agent_pb2.LivenessRequest(from_node_id="rogue"),
                                                                 metadata=md, timeout=5))),
            }
            assert set(calls) == GUARDED, "call every RPC that needs the token here"
            for rpc, call in calls.items():
                for name, metadata in (("none", ()), ("made-up", JobToken("0" * 64).metadata())):
                    try:
                        await call(metadata)
                        out[f"{rpc}/{name}"] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        out[f"{rpc}/{name}"] = exc.code()
            await stub.Health(agent_pb2.HealthRequest(), timeout=5)  # probes still get an answer
        return out

    return asyncio.run(main())


@pytest.mark.slow
def test_a_rogue_client_is_refused_by_a_running_job_whose_own_replication_goes_on(tmp_path, etcd_endpoint, job_id):
    log = tmp_path / "events.jsonl"
    args = ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1:2", "--lease-ttl", "2",
            "--first-round-wait", "1", *FAST_WARM, str(WORKER), str(tmp_path / "ck"), str(log), "300", str(tmp_path / "hold")]
    nodes = {n: Node(tmp_path, n, args).start() for n in ("a", "b")}

    def steps() -> list[dict]:
        try:
            return [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == "step"]
        except FileNotFoundError:
            return []

    try:
        wait_until(lambda: any(e.get("world") == 2 and e.get("step", 0) >= 20 for e in steps()), 90, "2 nodes training")
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", etcd_endpoint, "--job-id", job_id, "--json"],
            capture_output=True, text=True, timeout=30).stdout)
        addrs = [n["agent_addr"] for n in status["nodes"].values()]
        assert len(addrs) == 2
        # ftrt status read the token from etcd: the agents told it their workers
        assert all(w and "pid" in w[0] for w in status["workers"].values()), status["workers"]
        for addr in addrs:
            assert rogue_calls(addr) == {f"{rpc}/{name}": grpc.StatusCode.UNAUTHENTICATED
                                         for rpc in GUARDED for name in ("none", "made-up")}
        for n in nodes.values():  # attack 4: each refusal is said, once per caller and call (not per attempt)
            for rpc in GUARDED:
                assert wait_until(lambda: f"refused {rpc} from ipv4:127.0.0.1: it did not show the job's token"
                                  in n.log(), 10, f"{n.node_id}'s line about the refused {rpc}")
        # Attack 2 of issue 32, with the job's real token: b's own checkpoint, its step raised by
        # 100000 and every byte zeroed, sent to a as b's replica. a refuses it: b never claimed it.
        a_addr = status["nodes"]["a"]["agent_addr"]
        token = job_token_of(etcd_endpoint, job_id)
        code, why, rank = forge_replica_in_job(etcd_endpoint, job_id, victim="b", holder="a")
        assert code == grpc.StatusCode.PERMISSION_DENIED and "not step 1000" in why, (code, why)
        assert wait_until(lambda: f"refused a memory replica said to be node b's rank {rank}" in nodes["a"].log(), 10,
                          "a's log line about the refusal")
        assert asyncio.run(service.status(a_addr, token, timeout=5)).replicas_refused == 1
        shown = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", etcd_endpoint, "--job-id",
                                job_id], capture_output=True, text=True, timeout=30).stdout
        assert "refused 1 memory replica(s) (its log says why" in shown, shown
        # The job's own agents hold the token: a node's loss is restored from its peer's replica.
        killed_at = kill_at_rest(nodes["b"], nodes["a"], tmp_path / "hold", lambda: max(e["step"] for e in steps()))
        restore = wait_until(lambda: next((e for e in (json.loads(x) for x in log.read_text().splitlines())
                                           if e.get("event") == "restore" and e["time"] > killed_at), None),
                             60, "the survivor's restore")
        assert restore["tier"] == "memory" and restore["ok"], restore
        assert restore["step"] <= max(e["step"] for e in steps() if e["time"] <= killed_at), restore  # not forged
        assert nodes["a"].wait(120) == 0, nodes["a"].log()
        assert not list(Path("/dev/shm").glob("ftrt-mem-*/replicas/rogue")) and not list(
            Path("/tmp").glob("ftrt-mem-*/replicas/rogue"))
    finally:
        for n in nodes.values():
            n.cleanup()


def test_refusals_are_logged_once_per_caller_and_call_with_the_count_left_out(caplog):
    from ftrt.auth import RefusalLog

    now = [0.0]
    refusals = RefusalLog(every=10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="ftrt.auth"):
        for _ in range(5):
            refusals.note("ipv4:10.0.0.9:4411", "Status")
        refusals.note("ipv4:10.0.0.9:4412", "PutReplica")  # another call: a line of its own
        now[0] = 11.0
        refusals.note("ipv4:10.0.0.9:4413", "Status")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused Status from ipv4:10.0.0.9: it did not show the job's token",
                     "refused PutReplica from ipv4:10.0.0.9: it did not show the job's token",
                     "refused Status from ipv4:10.0.0.9: it did not show the job's token (4 more refused since the "
                     "last line)"], lines
