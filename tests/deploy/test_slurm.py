"""deploy/slurm/ftrt.sbatch, run here as Slurm would run it: a stand-in ``srun`` starts one task
per node on this machine (``SLURM_NODEID`` set, SIGTERM forwarded to every task as Slurm does),
``scontrol`` names the nodes, and the real ``ftrt launch`` and ``ftrt etcd`` do the rest (the
script starts its own etcd on the first node)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftrt.chaos.local import wait_until
from ftrt.store.etcd_server import free_port

pytestmark = pytest.mark.slow

SBATCH = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "ftrt.sbatch"

SRUN = r'''#!PYTHON
"""Stand-in srun: --nodes=1 ... CMD runs CMD once; otherwise SLURM_JOB_NUM_NODES tasks of CMD,
each with its SLURM_NODEID; SIGTERM goes to every task; the exit code is the worst task's."""
import os, signal, subprocess, sys
args = sys.argv[1:]
single = any(a in ("--nodes=1", "-N1") for a in args)
i = 0
while i < len(args) and args[i].startswith("-"):
    i += 2 if args[i] in ("-w", "--nodes", "--ntasks") else 1
cmd = args[i:]
n = 1 if single else int(os.environ["SLURM_JOB_NUM_NODES"])
procs = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(k), "SLURM_PROCID": str(k)})
         for k in range(n)]
signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in procs])
codes = [p.wait() for p in procs]
sys.exit(max((abs(c) for c in codes), default=0))
'''


def _shims(tmp: Path) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.replace("PYTHON", sys.executable))
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # show hostnames: the first node
    (bin_dir / "hostname").write_text("#!/bin/sh\necho 127.0.0.1\n")  # hostname -I: loopback only here
    (bin_dir / "ftrt").write_text(f"#!/bin/sh\nexec {sys.executable} -m ftrt.cli.main \"$@\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_NUM_NODES": "2",
            "FTRT_NPROC_PER_NODE": "1", "FTRT_ETCD_PORT": str(free_port()), "TMPDIR": str(tmp)}


def _steps(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _script(tmp: Path, steps: int) -> list[str]:
    return ["-m", "ftrt.examples.ddp_steps", "--plain", "--no-in-place", "--steps", str(steps), "--step-time", "0.05",
            "--progress", str(tmp / "p.jsonl"), "--ckpt", str(tmp / "ck.json"), "--boundary"]


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0


def test_the_sbatch_script_runs_a_two_node_job_with_its_own_etcd(tmp_path):
    res = subprocess.run(["bash", str(SBATCH), *_script(tmp_path, 30)], env=_shims(tmp_path), cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = _steps(tmp_path / "p.jsonl")
    assert [x["step"] for x in lines] == list(range(30)) and {x["world"] for x in lines} == {2}
    assert "joined job 'slurm-4242' as node0" in res.stderr and "as node1" in res.stderr
    assert "nothing tells etcd to refuse anyone" not in res.stderr  # its own etcd is closed: agents show a certificate
    assert "etcd at https://127.0.0.1:" in res.stderr or "etcd https://127.0.0.1:" in res.stderr, res.stderr[-2000:]
    assert not list(Path(os.environ["FTRT_STATE_DIR"]).glob("slurm-4242"))  # its credentials went with it


def test_slurm_s_sigterm_before_the_time_limit_drains_every_node_and_the_job_ends_cleanly(tmp_path):
    proc = subprocess.Popen(["bash", str(SBATCH), *_script(tmp_path, 100000)], env=_shims(tmp_path), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_until(lambda: sum(x["world"] == 2 for x in _steps(tmp_path / "p.jsonl")) >= 5, 120, "steps at world 2")
        proc.send_signal(signal.SIGTERM)  # --signal=B:TERM@120: Slurm signals the batch shell
        out, _ = proc.communicate(timeout=100)  # the script's --drain-timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("draining (SIGTERM)") == 2 and out.count("drained in") == 2, out[-3000:]
    steps = [x["step"] for x in _steps(tmp_path / "p.jsonl")]
    saved = json.loads((tmp_path / "ck.json").read_text())["step"]
    assert saved == max(steps)  # the last step trained is the one saved: a requeued job redoes nothing
