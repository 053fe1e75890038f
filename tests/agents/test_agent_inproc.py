"""An agent run in this process (``ftrt.agents.agent.main``) against a real etcd reached through a
store that fails on cue: an etcd failure at a precise step of the agent's work must be retried,
not end the agent."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from ftrt.agents.agent import main
from ftrt.agents.cli import parse_launch_args
from ftrt.errors import StoreUnavailable, WorkerFailure
from ftrt.jobkeys import JobKeys
from ftrt.store.api import Put
from ftrt.store.etcd import EtcdStore


class FailingMasterPut:
    """The agent's store, except that the first transaction putting a round's master record fails
    as an unreachable etcd does."""

    def __init__(self, store: EtcdStore, keys: JobKeys) -> None:
        self._store = store
        self._keys = keys
        self.failed = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def txn(self, compares, success, failure=(), **kw):
        if not self.failed and any(isinstance(op, Put) and op.key.startswith(self._keys.masters) for op in success):
            self.failed += 1
            raise StoreUnavailable("etcd did not answer (injected by the test)")
        return await self._store.txn(compares, success, failure, **kw)


async def test_a_master_record_that_could_not_be_published_is_published_on_the_next_pass(
        etcd_endpoint, job_id, tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    cfg = parse_launch_args(["--node-id", "solo", "--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1",
                             "--nproc-per-node", "1", "--no-warm", "--log-dir", str(tmp_path / "logs"),
                             str(script)])
    keys = JobKeys(job_id)
    store = FailingMasterPut(EtcdStore(etcd_endpoint), keys)
    rc = await asyncio.wait_for(main(cfg, store=store), 90)
    assert store.failed == 1  # the failure happened, where it was meant to
    assert rc == 0  # and the job still ran to its end
    logs = list((tmp_path / "logs").rglob("rank-0.log"))
    assert logs and b"rank 0 of 1" in logs[0].read_bytes(), sys.stderr


async def test_a_store_holder_that_never_starts_restarts_the_round_then_fails_the_job_naming_why(
        etcd_endpoint, job_id, tmp_path, monkeypatch):
    (tmp_path / "hangs_on_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    script = tmp_path / "ok.py"
    script.write_text("print('never runs')\n")
    cfg = parse_launch_args(["--node-id", "solo", "--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1",
                             "--nproc-per-node", "1", "--no-warm", "--warm-import", "hangs_on_import",
                             "--worker-start-timeout", "2", "--max-restarts", "1", str(script)])
    store = EtcdStore(etcd_endpoint)
    with pytest.raises(WorkerFailure) as failed:
        await asyncio.wait_for(main(cfg, store=store), 60)  # without the bound: stuck, cut at 60 s
    assert "did not start within 2 s (--worker-start-timeout)" in str(failed.value)
    assert "restart budget" in str(failed.value)


class GoesDown:
    """The agent's store, until :attr:`down` is set: from then on every call fails as an unreachable
    etcd does (its lease cannot be renewed, nor a new one granted)."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self.down = False

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr) or name in ("close", "watch_prefix"):
            return attr

        async def call(*args, **kwargs):
            if self.down:
                raise StoreUnavailable("etcd did not answer (injected by the test)")
            return await attr(*args, **kwargs)

        return call


async def test_a_fenced_agent_asked_to_leave_leaves_at_once(etcd_endpoint, job_id, tmp_path, caplog):
    script = tmp_path / "sleeps.py"
    script.write_text("import ftrt, time\nrt = ftrt.init()\nwhile True:\n    rt.heartbeat(0)\n    time.sleep(0.2)\n")
    notice = tmp_path / "preempted"
    cfg = parse_launch_args(["--node-id", "solo", "--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1",
                             "--nproc-per-node", "1", "--no-warm", "--lease-ttl", "2", "--preemption-file",
                             str(notice), "--preemption-poll", "0.1", str(script)])
    store = GoesDown(EtcdStore(etcd_endpoint))
    agent = asyncio.create_task(main(cfg, store=store))
    from ftrt.chaos.local import wait_until, worker_pids

    await asyncio.to_thread(wait_until, lambda: worker_pids(etcd_endpoint, job_id), 60, "the worker to run")
    with caplog.at_level("INFO", logger="ftrt.agents"):
        store.down = True  # the lease cannot be renewed: the agent fences itself and cannot rejoin
        await asyncio.to_thread(wait_until, lambda: "rejoining failed" in caplog.text, 30, "the agent fenced")
        assert not agent.done()
        notice.touch()  # then the node is asked to leave: nothing to hand over, so it leaves at once
        assert await asyncio.wait_for(agent, 30) == 0
    assert "asked to leave while fenced (preemption notice" in caplog.text
