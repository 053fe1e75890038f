"""Mutual TLS between agents: a running job's agents refuse anyone without a certificate of the
job's CA, while their own replication and liveness streams (and ``ftrt status``) work over it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest

from ftrt.auth import JobToken, read_token
from ftrt.agents.peers.tls import AgentTls
from ftrt.errors import ConfigError
from ftrt.jobkeys import JobKeys
from ftrt.store.certs import tls_dir
from ftrt.store.etcd import EtcdStore
from ftrt.v1 import agent_pb2, agent_pb2_grpc
from tests.agents.harness import FAST_WARM, Node, kill_at_rest, wait_until

WORKER = Path(__file__).parents[1] / "checkpoint" / "tier_worker.py"


def call_status(addr: str, channel_for, token: JobToken | None = None) -> grpc.StatusCode:
    async def main():
        async with channel_for(addr) as channel:
            try:
                await agent_pb2_grpc.AgentServiceStub(channel).Status(
                    agent_pb2.StatusRequest(), timeout=3, metadata=token.metadata() if token else ())
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    return asyncio.run(main())


def job_token_of(endpoint: str, job_id: str) -> JobToken:
    async def main():
        store = EtcdStore(endpoint, timeout=5.0)
        try:
            return await read_token(store, JobKeys(job_id))
        finally:
            await store.close()

    token = asyncio.run(main())
    assert token is not None
    return token


def put_replica(addr: str, tls: AgentTls) -> grpc.StatusCode:
    async def main():
        async with tls.channel(addr) as channel:
            try:
                chunk = agent_pb2.ReplicaChunk(source_node="rogue", rank=0, step=1, index_json="{}")
                await agent_pb2_grpc.AgentServiceStub(channel).PutReplica(
                    iter([chunk]), metadata=JobToken("0" * 64).metadata(), timeout=3)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    return asyncio.run(main())


def test_agent_tls_settings_are_checked_naming_the_flag(tmp_path):
    files = tls_dir(tmp_path / "tls")
    with pytest.raises(ConfigError, match="need --tls-ca"):
        AgentTls(str(files.server_cert), str(files.server_key)).check()
    with pytest.raises(ConfigError, match="--tls-ca needs --tls-cert"):
        AgentTls(ca=str(files.ca)).check()
    with pytest.raises(ConfigError, match="--tls-cert was given without --tls-key"):
        AgentTls(cert=str(files.server_cert), ca=str(files.ca)).check()
    with pytest.raises(ConfigError, match="not a PEM certificate and its matching private key"):
        AgentTls(str(files.server_cert), str(files.client_key()), str(files.ca)).check()
    assert AgentTls(str(files.server_cert), str(files.server_key), str(files.ca)).check().enabled


@pytest.mark.slow
def test_a_job_over_agent_mtls_refuses_outsiders_and_recovers_from_its_replicas(tmp_path, etcd_endpoint, job_id):
    files, foreign = tls_dir(tmp_path / "tls"), tls_dir(tmp_path / "foreign")
    tls = AgentTls(str(files.server_cert), str(files.server_key), str(files.ca))
    log = tmp_path / "steps.jsonl"
    args = ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1:2", "--lease-ttl", "2",
            "--first-round-wait", "1", *FAST_WARM, *tls.flags(), str(WORKER), str(tmp_path / "ck"), str(log), "300", str(tmp_path / "hold")]
    nodes = {n: Node(tmp_path, n, args).start() for n in ("a", "b")}

    def events(kind: str) -> list[dict]:
        try:
            return [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == kind]
        except FileNotFoundError:
            return []

    try:
        wait_until(lambda: any(e["world"] == 2 and e["step"] >= 20 for e in events("step")), 90, "2 nodes training")
        base = [sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", etcd_endpoint, "--job-id", job_id, "--json"]
        plain = json.loads(subprocess.run(base, capture_output=True, text=True, timeout=30).stdout)
        assert len(plain["workers"]) == 2 and all("error" in ws[0] for ws in plain["workers"].values())
        st = json.loads(subprocess.run([*base, *tls.flags()], capture_output=True, text=True, timeout=30).stdout)
        assert sorted(w["rank"] for ws in st["workers"].values() for w in ws if w["rank"] >= 0) == [0, 1]
        for addr in (n["agent_addr"] for n in st["nodes"].values()):
            assert call_status(addr, grpc.aio.insecure_channel) == grpc.StatusCode.UNAVAILABLE
            no_cert = grpc.ssl_channel_credentials(root_certificates=files.ca.read_bytes())
            assert call_status(addr, lambda a: grpc.aio.secure_channel(a, no_cert)) == grpc.StatusCode.UNAVAILABLE
            outsider = AgentTls(str(foreign.server_cert), str(foreign.server_key), str(files.ca))
            assert call_status(addr, outsider.channel) == grpc.StatusCode.UNAVAILABLE
            assert put_replica(addr, tls) == grpc.StatusCode.UNAUTHENTICATED  # a certificate is not the token
            assert call_status(addr, tls.channel) == grpc.StatusCode.UNAUTHENTICATED
            assert call_status(addr, tls.channel, job_token_of(etcd_endpoint, job_id)) == grpc.StatusCode.OK
        killed_at = kill_at_rest(nodes["b"], nodes["a"], tmp_path / "hold", lambda: max(e["step"] for e in events("step")))
        restore = wait_until(lambda: next((e for e in events("restore") if e["time"] > killed_at), None), 60,
                             "the survivor's restore")
        assert restore["tier"] == "memory" and restore["ok"], (restore, nodes["a"].log()[-3000:])  # the peer's replica came over mTLS
        assert nodes["a"].wait(120) == 0, nodes["a"].log()
    finally:
        for n in nodes.values():
            n.cleanup()
