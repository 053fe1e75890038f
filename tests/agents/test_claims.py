"""Memory replicas bound to their owner (attack 2 of issue 32, at the unit level): a caller with the
job's token cannot store a checkpoint its owner did not claim, whatever it says it is; under
mutual TLS a node can only send its own. Real gRPC, an in-memory store for the claims (their etcd
contract is the end-to-end test in test_auth.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from pathlib import Path

import grpc
import grpc.aio
import pytest

from ftrt.agents.peers.claims import KEPT, Claim, ClaimBook, ClaimRecord, ReplicaGate, judge
from ftrt.agents.peers.replicator import Replicator
from ftrt.agents.peers.service import AgentServicer, bind_server, serve
from ftrt.agents.peers.tls import AgentTls
from ftrt.auth import JobToken
from ftrt.chaos.local import until
from ftrt.checkpoint import memtier
from ftrt.errors import StoreError
from ftrt.store.certs import tls_dir
from ftrt.store.memory import MemoryStore
from ftrt.v1 import agent_pb2, agent_pb2_grpc
from tests.agents.replicas import KEYS, registered, replica_server, replicating
from tests.agents.test_replicator import commit, replica_step

TOKEN = JobToken("3" * 64)
C = Claim(step=7, round=2, world=2, size=4096, sha256="a" * 64)


def test_a_replica_is_judged_against_its_owners_claims():
    record = ClaimRecord("b", 0, "10.0.0.2", (Claim(6, 2, 2, 4096, "b" * 64), C))
    assert judge("b", 0, C, record, None) is None
    assert judge("b", 0, C, record, frozenset({"b"})) is None  # the certificate names the node
    assert judge("b", 0, C, record, frozenset({"10.0.0.2", "localhost"})) is None  # or its host
    assert "claims no memory checkpoint" in judge("b", 0, C, None, None)
    assert "names node a rank 0" in judge("b", 0, C, ClaimRecord("a", 0, "h", (C,)), None)
    assert "a node may only send its own" in judge("b", 0, C, record, frozenset({"a", "127.0.0.1"}))
    raised = Claim(100007, 2, 2, 4096, "a" * 64)
    assert "claimed steps 6, 7 of rank 0, not step 100007" in judge("b", 0, raised, record, None)
    zeroed = Claim(7, 2, 2, 4096, "0" * 64)
    assert "the bytes or the index were changed" in judge("b", 0, zeroed, record, None)


def test_claims_are_written_only_under_the_nodes_live_registration_and_the_newest_are_kept():
    async def main():
        store = MemoryStore()
        book = await registered(store, "b")
        for step in range(KEPT + 2):
            await book.publish(0, Claim(step, 1, 2, 64, f"{step:064x}"))
        kv, _ = await store.get(KEYS.mem_claim("b", 0))
        record = ClaimRecord.decode(kv.value)
        assert [c.step for c in record.claims] == list(range(2, KEPT + 2)), record
        assert kv.lease != 0  # goes with the node's lease
        other = await store.grant_lease(60)
        stale = ClaimBook(store, KEYS, "b", "127.0.0.1", lambda: (other.id, "incarnation-0"))
        with pytest.raises(StoreError, match="no longer under lease"):
            await stale.publish(1, C)  # an old incarnation's lease: the registration is not under it
        with pytest.raises(StoreError, match="holds no registration"):
            await ClaimBook(store, KEYS, "b", "127.0.0.1", lambda: None).publish(1, C)
        assert (await store.get(KEYS.mem_claim("b", 1)))[0] is None

    asyncio.run(main())


def forged(mem_dir: Path, rank: int, *, source: str = "a", step_raise: int = 0,
           zero: bool = True) -> list[agent_pb2.ReplicaChunk]:
    """A replica stream an attacker with the token would send as node ``source`` (whose memory
    directory is ``mem_dir``): its own index of ``rank`` (step raised by ``step_raise``) with
    every byte zeroed (unless not ``zero``), and a correct checksum."""
    index = json.loads((mem_dir / "own" / f"rank-{rank}" / "current.json").read_text())
    index["step"] += step_raise
    data = b"\0" * index["size"] if zero else (mem_dir / "own" / f"rank-{rank}" / f"slot-{index['slot']}.bin").read_bytes()
    index_json = json.dumps(index)
    return [agent_pb2.ReplicaChunk(source_node=source, rank=rank, step=index["step"], index_json=index_json),
            agent_pb2.ReplicaChunk(data=data),
            agent_pb2.ReplicaChunk(sha256=hashlib.sha256(index_json.encode() + data).hexdigest())]


async def put(port: int, stream: list[agent_pb2.ReplicaChunk], tls: AgentTls | None = None) -> tuple[grpc.StatusCode, str]:
    channel = tls.channel(f"127.0.0.1:{port}") if tls else grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    async with channel:
        try:
            await agent_pb2_grpc.AgentServiceStub(channel).PutReplica(iter(stream), metadata=TOKEN.metadata(),
                                                                    timeout=10)
            return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()


async def replicated(rep: Replicator, src: Path, dst: Path, step: int) -> None:
    """Save ``step`` as rank 0's sharded memory checkpoint in ``src`` and wait for its replica in ``dst``."""
    commit(src, 0, step, sharded=True)
    rep.notify(0)
    await until(lambda: replica_step(dst, 0) == step, 10, f"the replica of step {step}")


def test_a_forged_replica_with_the_token_is_refused_logged_and_counted_and_never_restored(tmp_path, caplog):
    src, dst = tmp_path / "a", tmp_path / "b"

    async def main():
        async with replicating(src, dst, TOKEN) as (rep, port, servicer):
            for step in (44, 45):
                await replicated(rep, src, dst, step)
            refusals = {
                "step raised": await put(port, forged(src, 0, step_raise=100000)),
                "bytes zeroed": await put(port, forged(src, 0)),
            }
            return refusals, servicer.gate.refused

    with caplog.at_level(logging.WARNING, logger="ftrt.agents.peers.claims"):
        refusals, refused = asyncio.run(main())
    assert refusals["step raised"][0] == grpc.StatusCode.PERMISSION_DENIED
    assert "claimed steps 44, 45 of rank 0, not step 100045" in refusals["step raised"][1]
    assert refusals["bytes zeroed"][0] == grpc.StatusCode.PERMISSION_DENIED
    assert "the bytes or the index were changed" in refusals["bytes zeroed"][1]
    assert refused == 2 and caplog.text.count("refused a memory replica said to be node a's rank 0") == 2
    held = memtier.scan(str(dst))
    assert sorted(m["step"] for m in held) == [44, 45], held  # nothing forged, and both real copies kept
    for m in held:
        assert Path(m["file"]).read_bytes() != b"\0" * m["size"]  # the real bytes, not the zeroed ones
    assert sorted(p.name for p in (dst / "replicas" / "a" / "rank-0").iterdir()) == [
        "current.json", "previous.json", "slot-0.bin", "slot-1.bin"]  # and nothing of the refused streams


def test_under_mutual_tls_a_node_can_only_send_its_own_checkpoints(tmp_path):
    """Node a's certificate names only the loopback; node b registered with host 10.9.9.9 and a
    certificate naming b. With the job's CA and token, a cannot store a checkpoint as b, even one
    b claimed; b can."""
    ca = tls_dir(tmp_path / "a")
    (tmp_path / "b").mkdir(mode=0o700)
    for name in ("ca.pem", "ca-key.pem"):
        shutil.copy(tmp_path / "a" / name, tmp_path / "b" / name)
    as_b = tls_dir(tmp_path / "b", hosts=["b"])
    tls_a = AgentTls(str(ca.server_cert), str(ca.server_key), str(ca.ca))
    tls_b = AgentTls(str(as_b.server_cert), str(as_b.server_key), str(ca.ca))
    src, dst = tmp_path / "mem-b", tmp_path / "mem-dst"

    async def main():
        store = MemoryStore()
        server, port = bind_server("127.0.0.1", 0, tls_a)
        servicer = AgentServicer(None, str(dst), TOKEN, ReplicaGate(store, KEYS))
        await serve(server, servicer)
        try:
            commit(src, 0, 9, sharded=True)
            book = await registered(store, "b", host="10.9.9.9")
            stream = forged(src, 0, source="b", zero=False)
            index = json.loads(stream[0].index_json)
            await book.publish(0, Claim(index["step"], index["round"], index["world"], index["size"], stream[-1].sha256))
            return await put(port, stream, tls_a), await put(port, stream, tls_b), servicer.gate.refused
        finally:
            await server.stop(None)

    as_a, own, refused = asyncio.run(main())
    assert as_a[0] == grpc.StatusCode.PERMISSION_DENIED and "a node may only send its own" in as_a[1], as_a
    assert own == (grpc.StatusCode.OK, ""), own
    assert refused == 1
    assert [m["step"] for m in memtier.scan(str(dst))] == [9]


def forge_replica_in_job(etcd: str, job_id: str, victim: str, holder: str) -> tuple[grpc.StatusCode, str, int]:
    """Attack 2 of issue 32 on a running job, as an attacker on the host with the job's token does
    it: ``victim``'s own newest memory checkpoint (read from its node's memory directory), its
    step raised by 100000 and every byte zeroed, sent to ``holder``'s agent as ``victim``'s
    replica. Returns the call's status, its details and the rank forged."""
    import os

    from ftrt.auth import read_token
    from ftrt.jobkeys import JobKeys
    from ftrt.records import NodeRecord, decode
    from ftrt.store.etcd import EtcdStore

    async def main():
        store = EtcdStore(etcd, timeout=5.0)
        try:
            keys = JobKeys(job_id)
            records = {n: decode(NodeRecord, (await store.get(keys.node(n)))[0].value) for n in (victim, holder)}
            token = await read_token(store, keys)
        finally:
            await store.close()
        pid = records[victim].pid
        roots = [Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp"))]
        mem = next(d for root in roots for d in root.glob(f"ftrt-mem-{pid}-*"))
        rank = int(next((mem / "own").glob("rank-*/current.json")).parent.name.split("-")[1])
        channel = grpc.aio.insecure_channel(records[holder].agent_addr)
        async with channel:
            try:
                await agent_pb2_grpc.AgentServiceStub(channel).PutReplica(
                    iter(forged(mem, rank, source=victim, step_raise=100000)), metadata=token.metadata(), timeout=10)
                return grpc.StatusCode.OK, "", rank
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details(), rank

    return asyncio.run(main())


def test_a_claim_that_cannot_be_written_fails_that_copy_only_and_replication_goes_on(tmp_path, caplog):
    """etcd refusing one claim (here: the node holds no registration for a moment, as while it
    rejoins) fails that copy with the reason in the log; the next checkpoint still arrives."""
    src, dst = tmp_path / "a", tmp_path / "b"

    async def main():
        store = MemoryStore()
        server, port, _ = await replica_server(str(dst), store, TOKEN)
        live = await registered(store, "a")
        registration = [None]
        book = ClaimBook(store, KEYS, "a", "127.0.0.1", lambda: registration[0])
        rep = Replicator("a", str(src), TOKEN, book, interval=0.0)
        try:
            rep.set_peers([f"127.0.0.1:{port}"])
            commit(src, 0, 1, sharded=True)
            rep.notify(0)
            await until(lambda: "holds no registration" in caplog.text, 10, "the failed copy's warning")
            registration[0] = live.registration()
            await replicated(rep, src, dst, 2)  # the next checkpoint goes
        finally:
            await rep.close()
            await server.stop(None)

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "replicating rank 0's memory checkpoint to" in caplog.text


def test_claims_are_written_again_under_a_new_lease_and_two_at_once_both_land():
    async def main():
        store = MemoryStore()
        lease = [(await store.grant_lease(60)).id]
        await store.put(KEYS.node("b"), b"{}", lease=lease[0])
        book = ClaimBook(store, KEYS, "b", "127.0.0.1", lambda: (lease[0], "i"))
        first, second = Claim(5, 1, 2, 64, "1" * 64), Claim(6, 1, 2, 64, "2" * 64)
        await asyncio.gather(book.publish(0, first), book.publish(0, second))  # two links at once
        both = ClaimRecord.decode((await store.get(KEYS.mem_claim("b", 0)))[0].value).claims
        await store.revoke_lease(lease[0])  # the node lost its lease and registered again
        lease[0] = (await store.grant_lease(60)).id
        await store.put(KEYS.node("b"), b"{}", lease=lease[0])
        await book.publish(0, second)  # the same checkpoint, sent to a new peer after the rejoin
        kv, _ = await store.get(KEYS.mem_claim("b", 0))
        return both, kv

    both, kv = asyncio.run(main())
    assert set(both) == {Claim(5, 1, 2, 64, "1" * 64), Claim(6, 1, 2, 64, "2" * 64)}
    assert kv is not None and ClaimRecord.decode(kv.value).claims == (Claim(6, 1, 2, 64, "2" * 64),)


def test_an_old_claimed_copy_replayed_is_refused_and_streams_are_bounded(tmp_path):
    """A caller with the token and a node's old arena bytes (claimed, so they pass the claim check)
    cannot push the newer replica out; nor can it hold more than one stream of a rank, or a
    stream larger than the node's free memory, open."""
    src, dst = tmp_path / "a", tmp_path / "b"

    async def main():
        async with replicating(src, dst, TOKEN) as (rep, port, servicer):
            await replicated(rep, src, dst, 3)
            old = forged(src, 0, zero=False)  # step 3, as claimed
            for step in (4, 5):
                await replicated(rep, src, dst, step)
            replayed = await put(port, old)
            huge = json.loads(old[0].index_json)
            huge["size"] = 1 << 60
            endless = [agent_pb2.ReplicaChunk(source_node="a", rank=0, step=huge["step"], index_json=json.dumps(huge))]
            too_big = await put(port, endless)
            return replayed, too_big, servicer.gate.refused

    replayed, too_big, refused = asyncio.run(main())
    assert replayed[0] == grpc.StatusCode.PERMISSION_DENIED and "older than the replica held" in replayed[1], replayed
    assert too_big[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "does not fit" in too_big[1], too_big
    assert refused == 1
    assert sorted(m["step"] for m in memtier.scan(str(dst))) == [4, 5]


def test_one_stream_of_a_rank_at_a_time_and_a_bound_on_all(tmp_path):
    from ftrt.agents.peers.claims import ReplicaBusy

    gate = ReplicaGate(MemoryStore(), KEYS, max_streams=2)
    with gate.stream("a", 0, 64, str(tmp_path)):
        with pytest.raises(ReplicaBusy, match="already arriving"):
            with gate.stream("a", 0, 64, str(tmp_path)):
                pass
        with gate.stream("a", 1, 64, str(tmp_path)):
            with pytest.raises(ReplicaBusy, match="2 replica streams are arriving"):
                with gate.stream("b", 0, 64, str(tmp_path)):
                    pass
    with gate.stream("a", 0, 64, str(tmp_path)):  # released once done
        pass
