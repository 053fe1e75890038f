"""The rollout fleet end to end: real etcd, real `ftrt rollout serve` processes, real trainers.

Every fault test compares the trainer's metrics lines with the fault-free fleet run of the same
config (bit for bit: rewards, losses, prompt ids, weight versions) and checks that the trainer
was never restarted.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest
import torch

from ftrt.auth import JobToken
from ftrt.v1 import rollout_pb2, rollout_pb2_grpc
from tests.agents.harness import FAST_WARM, Node
from tests.rollout.fleetkit import (Server, exact, fleet_config, freeze_holding_groups, lines, stop_all, trainer,
                                   wait_registered, wait_steps, wait_until)

# Whole trainer runs (the reference and the faulted one, 160 steps each) on a busy machine: the
# default 120 s covers neither the fixture plus the test nor the waits inside (`t.wait(240)`).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

STEPS = 160
CONFIG = [f"steps={STEPS}", "prompts_per_step=8", "group_size=4", "model.d_model=32", "model.n_layers=1",
          "model.n_heads=2", "checkpoint.url=null"]


def _fleet_run(tmp, etcd, job_id, name, servers=2, extra=(), during=None):
    """A one-process trainer against ``servers`` fresh servers; ``during(servers, metrics)`` injects
    faults while it runs. Returns the metrics lines and the servers' logs."""
    procs = [Server(tmp, etcd, job_id, f"{name}-s{i}") for i in range(servers)]
    t = None
    try:
        t = trainer(tmp, fleet_config(tmp, name, etcd, job_id, *CONFIG, *extra))
        if during is not None:
            during(procs, tmp / f"{name}.jsonl")
        assert t.wait(240) == 0, (tmp / "trainer.log").read_text()[-3000:]
    finally:
        stop_all([*procs, *([t] if t else [])])
    return lines(tmp / f"{name}.jsonl"), procs


@pytest.fixture(scope="module")
def reference(tmp_path_factory, etcd_server):
    tmp = tmp_path_factory.mktemp("fleet-ref")
    rows, _ = _fleet_run(tmp, etcd_server.endpoint, "fleet-ref", "ref")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["weight_version"] == r["step"] for r in rows)  # K = 0: the weights after the step before
    return rows


def test_a_killed_server_and_an_added_one_leave_the_run_bit_identical(tmp_path, reference, etcd_endpoint, job_id):
    added = []

    def faults(servers, metrics):
        wait_steps(metrics, 3)
        added.append(Server(tmp_path, etcd_endpoint, job_id, "added"))
        wait_registered(added)
        freeze_holding_groups(servers[0])
        servers[0].signal(signal.SIGKILL)  # its groups are lost: the connection resets

    try:
        rows, servers = _fleet_run(tmp_path, etcd_endpoint, job_id, "run", during=faults)
    finally:
        stop_all(added)
    assert exact(rows) == exact(reference)
    assert rows[-1]["resumes"] == 0 and rows[-1]["redone"] == 0  # the trainer never restarted
    assert sum(r["redispatched"] for r in rows) >= 1
    assert "now serving weight version" in added[0].log()  # the new server got the weights ...
    assert rows[-1]["rollout_servers"] == 2  # ... and took work in place of the dead one


def test_a_frozen_server_is_routed_around_and_rejoins(tmp_path, reference, etcd_endpoint, job_id):
    def faults(servers, metrics):
        wait_steps(metrics, 5)
        frozen = servers[1]
        freeze_holding_groups(frozen)
        # Its groups go elsewhere after request_timeout; it stays frozen until its lease is gone too.
        gone = f"rollout server {frozen.server_id} left the fleet: its lease is gone"
        wait_until(lambda: gone in (tmp_path / "trainer.log").read_text(), 60, "the frozen server's lease to go")
        frozen.signal(signal.SIGCONT)
        wait_until(lambda: frozen.log().count("registered as") == 2, 60, "the thawed server to register again")

    rows, servers = _fleet_run(tmp_path, etcd_endpoint, job_id, "run",
                               extra=["rollout.request_timeout=2"], during=faults)
    assert exact(rows) == exact(reference)
    assert rows[-1]["resumes"] == 0
    assert sum(r["redispatched"] for r in rows) >= 1


def test_no_server_fails_with_a_clear_error_instead_of_hanging(tmp_path, etcd_endpoint, job_id):
    t = trainer(tmp_path, fleet_config(tmp_path, "run", etcd_endpoint, job_id, *CONFIG, "rollout.wait_timeout=2"))
    try:
        rc = t.wait(90)
    finally:
        stop_all([t])
    out = (tmp_path / "trainer.log").read_text()
    assert rc != 0 and "No rollout server of job" in out and "rollout.wait_timeout" in out, out[-2000:]
    assert "Traceback" not in out


def test_pushes_need_the_token_and_a_bad_push_changes_nothing(tmp_path, reference, etcd_endpoint, job_id):
    """A rogue client, a corrupt push, then (attack 5 of issue 32) a complete, well-formed push with
    the job's token of the trainer's next version with every weight zeroed: the server keeps
    serving the versions it had, never holds the forged one, and the run is bit for bit the
    fault-free one."""
    holder = {}

    def faults(servers, metrics):
        wait_steps(metrics, 3)
        import asyncio

        from ftrt.auth import job_token
        from ftrt.jobkeys import JobKeys
        from ftrt.rollout.records import ServerRecord
        from ftrt.store.etcd import EtcdStore

        from ftrt.policy.spec import decode_spec
        from ftrt.rollout.engine import BuiltinEngine
        from ftrt.rollout.weights import DTYPES, Outgoing, chunks

        async def look():
            store = EtcdStore(etcd_endpoint)
            try:
                kv, _ = await store.get(JobKeys(job_id).rollout_server(servers[0].server_id))
                spec, _ = await store.get(JobKeys(job_id).rollout_spec)
                return ServerRecord.decode(kv.value), await job_token(store, JobKeys(job_id)), decode_spec(spec.value, "etcd")
            finally:
                await store.close()

        rec, token, spec = asyncio.run(look())
        zeroed = {name: torch.zeros(want.shape, dtype=DTYPES[want.dtype])
                  for name, want in BuiltinEngine(spec).expected.items()}
        with grpc.insecure_channel(rec.addr) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            before = stub.Info(rollout_pb2.InfoRequest())
            header = rollout_pb2.WeightChunk(version=999, digest="f" * 32, tensors=1)
            with pytest.raises(grpc.RpcError) as no_token:
                stub.PushWeights(iter([header, rollout_pb2.WeightChunk(commit=True)]))
            with pytest.raises(grpc.RpcError) as forged:
                stub.PushWeights(iter([header, rollout_pb2.WeightChunk(commit=True)]), metadata=token.metadata())
            nxt = max(before.held) + 1
            with pytest.raises(grpc.RpcError) as whole:  # complete and well-formed: only the claims tell
                stub.PushWeights(chunks(Outgoing(nxt, zeroed), keep_from=0), metadata=token.metadata())
            with pytest.raises(grpc.RpcError) as wrong_token:
                stub.Generate(rollout_pb2.GenerateRequest(step=0, prompt_id=0, version=0),
                              metadata=JobToken("x" * 64).metadata())
            after = stub.Info(rollout_pb2.InfoRequest())
        holder.update(before=before, after=after, no_token=no_token.value.code(), forged=forged.value,
                      wrong_token=wrong_token.value.code(), whole=whole.value, next=nxt,
                      zeroed=Outgoing(nxt, zeroed).digest)
        wait_registered(servers)  # the trainer may start with one: a slow second one is listed once it is there
        status = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "status", "--etcd", etcd_endpoint,
                                 "--job-id", job_id], capture_output=True, text=True, timeout=60)
        holder["status"] = status.stdout

    rows, servers = _fleet_run(tmp_path, etcd_endpoint, job_id, "run", during=faults)
    assert holder["no_token"] == grpc.StatusCode.UNAUTHENTICATED
    assert holder["wrong_token"] == grpc.StatusCode.UNAUTHENTICATED
    assert holder["forged"].code() == grpc.StatusCode.INVALID_ARGUMENT, holder["forged"].details()
    assert 999 not in holder["after"].held and holder["after"].held  # still serving real versions
    assert holder["whole"].code() == grpc.StatusCode.PERMISSION_DENIED, holder["whole"].details()
    assert "the weights were changed" in holder["whole"].details() or \
        f"the trainer made no version {holder['next']}" in holder["whole"].details(), holder["whole"].details()
    assert f"weight push of version {holder['next']} ({holder['zeroed'][:12]}) refused, not the trainer's" in \
        servers[0].log()
    assert exact(rows) == exact(reference)  # the reward curve is the fault-free one, bit for bit
    assert "rollout servers:" in holder["status"], holder["status"]
    for s in servers:  # `ftrt status` lists each server with the weight versions it holds
        assert f"{s.server_id}" in holder["status"] and "weight versions" in holder["status"]


# -- off-policy steps (K = 1) under ftrt launch: 2 ranks, the samples ahead in every checkpoint ---------

K1 = [*CONFIG[:-1], "rollout.max_off_policy_steps=1", "checkpoint.memory_interval=1", "checkpoint.interval=5"]


def _launch(tmp, etcd, job_id, name, recovery="in-place"):
    return ["--etcd", etcd, "--job-id", job_id, "--nnodes", "1", "--nproc-per-node", "2", "--lease-ttl", "2",
            "--first-round-wait", "1", "--recovery", recovery, *FAST_WARM, "-m", "ftrt.grpo", *K1, f"metrics_path={tmp / name}.jsonl",
            f"checkpoint.url={tmp / name}-ck", "rollout.mode=fleet", "progress=none"]


def _launched_run(tmp, etcd, job_id, name, during=None, recovery="in-place"):
    servers = [Server(tmp, etcd, job_id, f"{name}-s{i}") for i in range(2)]
    node = Node(tmp, name, _launch(tmp, etcd, job_id, name, recovery)).start()
    try:
        if during is not None:
            during(node, tmp / f"{name}.jsonl")
        assert node.wait(240) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
        stop_all(servers)
    return lines(tmp / f"{name}.jsonl"), node


@pytest.fixture(scope="module")
def reference_k1(tmp_path_factory, etcd_server):
    tmp = tmp_path_factory.mktemp("fleet-k1-ref")
    rows, _ = _launched_run(tmp, etcd_server.endpoint, "fleet-k1-ref", "ref")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["weight_version"] for r in rows] == [max(0, s - 1) for s in range(STEPS)]
    return rows


@pytest.mark.parametrize("recovery, victim", [("in-place", 1), ("in-place", 0), ("restart", 1)])
def test_off_policy_samples_ahead_survive_a_trainer_restart(tmp_path, reference_k1, etcd_endpoint, job_id, recovery,
                                                            victim):
    """A killed trainer rank trains exactly what the fault-free run trained. In place, when it is
    not the driver (rank 0), the driver keeps its process, its fleet and the step sampled ahead,
    and nothing is restored; when it is the driver, the step sampled ahead went with the weights it
    was sampled with (only the lost driver's fleet had them), so the ranks restore the memory
    checkpoint in place, which holds that step's samples. Restarted, the job resumes from memory
    the same way."""
    import os

    from ftrt.chaos.local import worker_pids

    def faults(node, metrics):
        wait_steps(metrics, 7)
        os.kill(worker_pids(etcd_endpoint, job_id)[victim], signal.SIGKILL)

    rows, node = _launched_run(tmp_path, etcd_endpoint, job_id, "run", during=faults, recovery=recovery)
    assert [r["step"] for r in rows] == list(range(STEPS))
    if recovery == "in-place" and victim == 1:
        assert rows[-1]["resumes"] == 0 and len({r["pid"] for r in rows}) == 1, rows[-1]
        assert "kept in place at step" in node.log()
    else:
        assert rows[-1]["resumes"] == 1 and len({r["pid"] for r in rows}) == 2, rows[-1]
        assert "from memory" in node.log(), node.log()[-3000:]
    assert exact(rows) == exact(reference_k1)


def test_a_server_that_loses_its_lease_fences_and_registers_again(tmp_path, etcd_endpoint, job_id):
    import asyncio

    from ftrt.grpo.config import load_config
    from ftrt.jobkeys import JobKeys
    from ftrt.policy.spec import PolicySpec
    from ftrt.store.etcd import EtcdStore

    keys = JobKeys(job_id)

    async def put_spec():
        store = EtcdStore(etcd_endpoint)
        try:
            await store.put(keys.rollout_spec, PolicySpec.of(load_config(None, CONFIG)).encode())
        finally:
            await store.close()

    async def lease_of() -> int:
        store = EtcdStore(etcd_endpoint)
        try:
            kv, _ = await store.get(keys.rollout_server("s0"))
            return kv.lease if kv else 0
        finally:
            await store.close()

    async def revoke(lease: int) -> None:
        store = EtcdStore(etcd_endpoint)
        try:
            await store.revoke_lease(lease)
        finally:
            await store.close()

    asyncio.run(put_spec())
    server = Server(tmp_path, etcd_endpoint, job_id, "s0", "--lease-ttl", "2")
    try:
        wait_registered([server])
        first = asyncio.run(lease_of())
        assert first
        asyncio.run(revoke(first))  # as if etcd had expired it
        wait_until(lambda: "fenced, serving nothing" in server.log(), 30, "the server to fence itself")
        wait_until(lambda: server.log().count("registered as") >= 2, 30, "it to register again")
        second = asyncio.run(lease_of())
        assert second and second != first
    finally:
        server.stop()
    assert server.proc.returncode is not None


def _put(etcd: str, key: str, value: bytes) -> None:
    import asyncio

    from ftrt.store.etcd import EtcdStore

    async def go():
        store = EtcdStore(etcd)
        try:
            await store.put(key, value)
        finally:
            await store.close()

    asyncio.run(go())


def test_a_server_stops_when_the_trainer_publishes_another_spec(tmp_path, etcd_endpoint, job_id):
    """A new run under the same job id (another temperature): the old server must not sample for it."""
    from ftrt.grpo.config import load_config
    from ftrt.jobkeys import JobKeys
    from ftrt.policy.spec import PolicySpec

    key = JobKeys(job_id).rollout_spec
    _put(etcd_endpoint, key, PolicySpec.of(load_config(None, CONFIG)).encode())
    server = Server(tmp_path, etcd_endpoint, job_id, "s0", "--lease-ttl", "2")
    try:
        wait_registered([server])
        _put(etcd_endpoint, key, PolicySpec.of(load_config(None, [*CONFIG, "temperature=0.7"])).encode())
        assert server.proc.wait(30) != 0
    finally:
        server.stop()
    assert "now publishes another policy spec" in server.log() and "Traceback" not in server.log()


def test_a_server_loads_models_only_from_its_model_dirs(tmp_path, etcd_endpoint, job_id):
    """The spec comes from etcd: a model path outside --model-dir is refused before anything loads."""
    from ftrt.grpo.config import load_config
    from ftrt.jobkeys import JobKeys
    from ftrt.policy.spec import PolicySpec

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    spec = PolicySpec.of(load_config(None, [*CONFIG, f"model.hf_path={outside}"]))
    _put(etcd_endpoint, JobKeys(job_id).rollout_spec, spec.encode())
    server = Server(tmp_path, etcd_endpoint, job_id, "s0", "--model-dir", str(tmp_path / "models"))
    try:
        assert server.proc.wait(60) == 2
    finally:
        server.stop()
    assert "under no --model-dir" in server.log() and "Traceback" not in server.log()
