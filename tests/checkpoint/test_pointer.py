"""The job's ``latest`` pointer: moved only by the current round, trusted by restore."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from ftrt.jobkeys import JobKeys
from ftrt.records import GroupRef, MasterRecord, RoundHeader, encode
from ftrt.checkpoint import Checkpointer
from ftrt.checkpoint.pointer import LatestPointer
from ftrt.checkpoint.storage import step_dir
from ftrt.errors import CheckpointSaveFailed
from ftrt.store.access import EtcdTarget
from ftrt.store.etcd import EtcdStore


def set_round(endpoint: str, job: str, n: int, planned_since: int = 0) -> None:
    async def go():
        store = EtcdStore(endpoint)
        try:
            rec = RoundHeader(round=n, groups=(GroupRef(1, 1, n),), first="a", planned_since=planned_since)
            await store.put(JobKeys(job).round, encode(rec))
        finally:
            await store.close()

    asyncio.run(go())


def latest_record(endpoint: str, job: str) -> dict:
    """The job's ``latest`` pointer as stored in etcd."""
    async def go():
        store = EtcdStore(endpoint)
        try:
            kv, _ = await store.get(JobKeys(job).ckpt + "latest")
            return json.loads(kv.value)
        finally:
            await store.close()

    return asyncio.run(go())


def test_current_round_moves_the_pointer_and_a_stale_round_cannot(tmp_path, etcd_endpoint, job_id):
    url = str(tmp_path / "ck")
    set_round(etcd_endpoint, job_id, 1)
    ptr1 = LatestPointer.open(EtcdTarget(etcd_endpoint), job_id, 1, url)
    state = {"w": torch.ones(3)}
    with Checkpointer(url, fence=ptr1) as ck:
        ck.save(10, state).wait()
    assert ptr1.latest() == 10
    set_round(etcd_endpoint, job_id, 2)  # the job moved on; round-1 workers are stale now
    with Checkpointer(url, fence=ptr1) as ck:
        h = ck.save(11, state)
        with pytest.raises(CheckpointSaveFailed, match="round"):
            h.wait()
    assert ptr1.latest() == 10
    assert not (tmp_path / "ck" / step_dir(11) / "manifest.json").exists()


def test_a_round_ended_by_a_planned_change_may_commit_its_boundary_step_but_never_move_latest_back(
        etcd_endpoint, job_id, tmp_path):
    from ftrt.errors import RoundChanged

    def publish_master(n: int) -> None:  # round n's workers have started
        async def go():
            store = EtcdStore(etcd_endpoint)
            try:
                await store.put(JobKeys(job_id).master(n), encode(MasterRecord(n, "127.0.0.1", 1)))
            finally:
                await store.close()

        asyncio.run(go())

    set_round(etcd_endpoint, job_id, 1)
    old = LatestPointer.open(EtcdTarget(etcd_endpoint), job_id, 1, str(tmp_path))
    new = LatestPointer.open(EtcdTarget(etcd_endpoint), job_id, 3, str(tmp_path))
    try:
        old.commit(10)
        set_round(etcd_endpoint, job_id, 2, planned_since=1)  # a node joined or drained
        set_round(etcd_endpoint, job_id, 3, planned_since=1)  # and another, at once
        old.check_round()
        old.commit(11)  # the step round 1 ended at: committed though round 3 is current
        assert old.latest() == 11
        new.commit(12)
        with pytest.raises(RoundChanged, match="already step 12"):
            old.commit(11)  # a late boundary commit never moves latest back
        publish_master(3)
        with pytest.raises(RoundChanged):
            old.commit(13)  # round 3's workers have started: round 1 commits nothing more
        set_round(etcd_endpoint, job_id, 4)  # a fault: no boundary for round 3's workers
        with pytest.raises(RoundChanged):
            new.check_round()
        assert new.latest() == 12
    finally:
        old.close()
        new.close()


def test_restore_ignores_a_manifest_above_the_pointer(tmp_path, etcd_endpoint, job_id):
    url = str(tmp_path / "ck")
    set_round(etcd_endpoint, job_id, 3)
    ptr = LatestPointer.open(EtcdTarget(etcd_endpoint), job_id, 3, url)
    with Checkpointer(url, fence=ptr) as ck:
        ck.save(5, {"w": torch.full((3,), 5.0)}).wait()
    # A checkpoint committed outside the job's fence (no pointer move), e.g. by a stale writer.
    with Checkpointer(url) as ck:
        ck.save(6, {"w": torch.full((3,), 6.0)}).wait()
    state = {"w": torch.zeros(3)}
    with Checkpointer(url, fence=ptr) as ck:
        assert ck.restore(state) == 5
    assert torch.equal(state["w"], torch.full((3,), 5.0))


SCRIPT = """
import json, sys, torch, torch.distributed as dist, ftrt
rt = ftrt.init()
dist.init_process_group("gloo")
ck = rt.checkpointer(sys.argv[1])
w = torch.zeros(4)
start = ck.restore({"w": w})
for step in range((start or 0) + 1, 4):
    w += 1
    ck.save(step, {"w": w}).wait()
ck.close()
dist.destroy_process_group()
"""


def test_checkpointer_from_the_runtime_moves_the_job_pointer(tmp_path, etcd_endpoint, job_id):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    url = str(tmp_path / "ck")
    res = subprocess.run(
        [sys.executable, "-m", "ftrt.cli.main", "launch", "--etcd", etcd_endpoint, "--job-id", job_id,
         "--nproc-per-node", "2", "--warm-import", "torch", str(script), url],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]

    ptr = latest_record(etcd_endpoint, job_id)
    assert ptr["step"] == 3 and ptr["round"] == 1 and ptr["url"] == url
