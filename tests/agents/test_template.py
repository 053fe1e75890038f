"""Spares forked from a warm template: real processes, a real pool, real exits and kills."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import pytest

from ftrt.agents.workers.pool import WorkerPool

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import gc, os, sys, time
print("imported:", "json" in sys.modules, "rank", os.environ["RANK"], "frozen:", gc.get_freeze_count() > 1000, flush=True)
mode = os.environ["TEST_MODE"]
if mode == "sleep":
    time.sleep(60)
sys.exit(int(os.environ["TEST_CODE"]))
"""


class Pool:
    """A pool of one worker per round whose output and exits the test reads."""

    def __init__(self, tmp_path):
        self.out = io.BytesIO()
        self.exits: list[tuple[int, int]] = []
        fence = tmp_path / "fence"
        fence.write_bytes(b"\0" * 64)
        self.script = tmp_path / "job.py"
        self.script.write_text(SCRIPT)
        self.pool = WorkerPool(
            nproc=1, fence_path=str(fence), warm=True, warm_imports=("json",),
            base_env={**os.environ, "FTRT_DIAG_OFF": "fence"}, log_dir=None,
            on_exit=lambda w: self.exits.append((w.pid, w.exit_code)), out=self.out,
        )

    async def warm_template(self):
        """Start the pool's template and wait until it is warm; the template."""
        await self.pool._template_ready(idle_grace=30)
        return self.pool._template

    async def assign(self, code: int, mode: str = "exit"):
        [w] = await self.pool.take()
        await w.ready.wait()
        self.pool.assign(w, local_rank=0, rank=3, round_no=1, script=str(self.script), module=None, argv=(),
                         env={"RANK": "3", "TEST_MODE": mode, "TEST_CODE": str(code)})
        return w


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_replacement_spares_are_forked_from_the_template_and_report_their_exit_codes(tmp_path):
    async def main():
        p = Pool(tmp_path)
        try:
            tpl = await p.warm_template()
            assert tpl is not None and tpl.usable
            w = await p.assign(7)
            assert parent_of(w.pid) == tpl.proc.pid  # forked, not started by the agent
            assert os.getpgid(w.pid) == w.pid  # its own group: the pool stops it by group
            await asyncio.wait_for(w.exited.wait(), 30)
            assert p.exits == [(w.pid, 7)]  # the code the template reaped
            # The warm heap was frozen before the fork: no full collection in the worker walks it.
            assert b"[rank3]: imported: True rank 3 frozen: True" in p.out.getvalue()
            # A worker stopped by the pool: SIGTERM reaches it, its code is the signal's.
            w2 = await p.assign(0, mode="sleep")
            assert parent_of(w2.pid) == tpl.proc.pid
            await asyncio.sleep(0.5)
            await p.pool.stop_running(grace=5)
            assert w2.exit_code == -signal.SIGTERM and len(p.exits) == 1  # a stop is not a failure
        finally:
            await p.pool.close(1)
        assert tpl.proc.exit_code is not None  # the template went with the pool

    asyncio.run(main())


def test_a_lost_template_takes_its_workers_with_it_and_spares_start_directly_after(tmp_path):
    async def main():
        p = Pool(tmp_path)
        try:
            tpl = await p.warm_template()
            w = await p.assign(0, mode="sleep")
            os.kill(tpl.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(w.exited.wait(), 30)
            assert p.exits == [(w.pid, -signal.SIGKILL)]  # reported as a failure, not lost
            assert p.pool._template is None
            w2 = await p.assign(5)  # started directly: the agent is its parent
            assert parent_of(w2.pid) == os.getpid()
            await asyncio.wait_for(w2.exited.wait(), 60)
            assert p.exits[-1] == (w2.pid, 5)
            await p.pool._template_ready(idle_grace=1)
            assert p.pool._template is None  # no second template after one failed
        finally:
            await p.pool.close(1)
        # Dead within moments (SIGKILLed with its template): gone, or a zombie its new parent has
        # not reaped yet (kill(pid, 0) succeeds on a zombie, so its state is what tells).
        for _ in range(100):
            if _dead(w.pid):
                break
            await asyncio.sleep(0.05)
        assert _dead(w.pid)

    asyncio.run(main())


def _dead(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def test_a_template_whose_warm_imports_initialised_cuda_refuses_to_fork(tmp_path, monkeypatch):
    fake = tmp_path / "fakecuda"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_initialized():\n        return True\n")
    monkeypatch.setenv("PYTHONPATH", f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    async def main():
        p = Pool(tmp_path)
        p.pool.warm_imports = ("torch",)
        try:
            assert await p.warm_template() is None
            assert b"initialised CUDA, so spares cannot be forked" in p.out.getvalue()
        finally:
            await p.pool.close(1)

    asyncio.run(main())


FORK_CHECK_SCRIPT = """
import json, os, sys
from pathlib import Path
import ftrt
rt = ftrt.init()
forked = os.getppid() != int(os.environ["FTRT_AGENT_PID"])  # a template's child, not the agent's
Path(sys.argv[1], f"round{rt.round}-rank{rt.rank}.json").write_text(json.dumps(
    {"forked": forked, "dcp": "torch.distributed.checkpoint" in sys.modules}))
if rt.round == 1 and rt.rank == 1:
    sys.exit(3)  # a worker failure: its replacement is a fork too
"""


def test_a_launched_nodes_workers_and_their_replacements_are_forks_of_one_template(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "forks.py"
    script.write_text(FORK_CHECK_SCRIPT)
    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts", "1", str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("round*-rank*.json")}
    assert set(seen) == {"round1-rank0", "round1-rank1", "round2-rank0", "round2-rank1"}, seen
    assert all(s == {"forked": True, "dcp": True} for s in seen.values()), seen
