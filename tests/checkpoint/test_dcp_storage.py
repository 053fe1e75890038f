"""``ftrt.checkpoint.dcp``: real ``dcp.save``/``dcp.load`` through ftrt's storage classes, real
files, a real etcd for the round fence, and 2 ranks on gloo under ``ftrt launch``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftrt.checkpoint.dcp import FtrtStorageReader, FtrtStorageWriter
from ftrt.checkpoint.pointer import LatestPointer
from ftrt.store.access import EtcdTarget
from ftrt.checkpoint.signing import CheckpointKey
from ftrt.checkpoint.storage import step_dir
from ftrt.errors import CheckpointCorrupt, RoundChanged
from tests.checkpoint.test_pointer import latest_record, set_round

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when no process group is up


def _state(v: float) -> dict:
    return {"w": torch.full((4, 3), float(v)), "extra": {"step": int(v), "name": f"s{int(v)}"}}


def _save(url: str, step: int, **kwargs) -> FtrtStorageWriter:
    writer = FtrtStorageWriter(url, step, key=kwargs.pop("key", None), fence=kwargs.pop("fence", None))
    dcp.save(_state(step), storage_writer=writer)
    return writer


def _load(reader: FtrtStorageReader) -> dict:
    state = _state(0)
    dcp.load(state, storage_reader=reader)
    return state


def test_a_save_is_committed_with_a_manifest_and_loads_back(tmp_path):
    url = str(tmp_path / "ck")
    writer = _save(url, 5)
    manifest = json.loads((tmp_path / "ck" / step_dir(5) / "manifest.json").read_text())
    assert manifest["step"] == 5 and ".metadata" in manifest["files"] and writer.committed_bytes > 0
    reader = FtrtStorageReader(url, key=None, latest=None)
    assert reader.step == 5
    state = _load(reader)
    assert torch.equal(state["w"], torch.full((4, 3), 5.0)) and state["extra"] == {"step": 5, "name": "s5"}


def test_the_reader_passes_over_an_uncommitted_or_changed_step(tmp_path):
    url = str(tmp_path / "ck")
    for step in (1, 2, 3):
        _save(url, step)
    (tmp_path / "ck" / step_dir(3) / "manifest.json").unlink()  # killed between its data and its commit
    with open(tmp_path / "ck" / step_dir(2) / ".metadata", "ab") as f:
        f.write(b"\x80")  # changed after its commit: a pickle that must never be read
    reader = FtrtStorageReader(url, key=None, latest=None)
    assert reader.step == 1
    assert torch.equal(_load(reader)["w"], torch.full((4, 3), 1.0))
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata has .* bytes"):
        FtrtStorageReader(url, step=2, key=None, latest=None)  # asked for by name: refused, never unpickled


def test_the_reader_ignores_steps_above_the_job_s_latest_and_says_when_there_is_nothing(tmp_path):
    url = str(tmp_path / "ck")
    _save(url, 4)
    _save(url, 6)
    assert FtrtStorageReader(url, key=None, latest=4).step == 4
    empty = FtrtStorageReader(str(tmp_path / "none"), key=None, latest=None)
    assert empty.step is None
    with pytest.raises(BaseException) as err:  # DCP's CheckpointException is a BaseException
        _load(empty)  # DCP reports it as a CheckpointException with our sentence
    assert "holds no committed checkpoint that verifies" in str(err.value)


def test_with_the_job_s_key_the_manifest_is_signed_and_another_key_is_not_trusted(tmp_path):
    url = str(tmp_path / "ck")
    key, other = CheckpointKey(b"k" * 32, "test"), CheckpointKey(b"o" * 32, "other")
    _save(url, 7, key=key)
    manifest = json.loads((tmp_path / "ck" / step_dir(7) / "manifest.json").read_text())
    assert manifest["checksum"] == "sha256" and manifest["signature"]
    assert FtrtStorageReader(url, key=key, latest=None).step == 7
    assert FtrtStorageReader(url, key=other, latest=None).step is None


def test_a_stale_round_commits_nothing_and_the_pointer_stays(tmp_path, etcd_endpoint, job_id):
    url = str(tmp_path / "ck")
    set_round(etcd_endpoint, job_id, 1)
    ptr = LatestPointer.open(EtcdTarget(etcd_endpoint), job_id, 1, url)
    try:
        _save(url, 10, fence=ptr)
        assert ptr.latest() == 10
        set_round(etcd_endpoint, job_id, 2)  # the job moved on: round-1 workers are stale
        with pytest.raises(BaseException) as err:  # DCP's CheckpointException is a BaseException
            _save(url, 11, fence=ptr)
        assert "RoundChanged" in repr(err.value) or isinstance(err.value, RoundChanged), repr(err.value)
        assert ptr.latest() == 10
        assert not (tmp_path / "ck" / step_dir(11) / "manifest.json").exists()
        assert FtrtStorageReader(url, key=None, latest=ptr.latest()).step == 10
    finally:
        ptr.close()


SCRIPT = """
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ftrt.checkpoint.dcp import FtrtStorageReader, FtrtStorageWriter
dist.init_process_group("gloo")
rank = dist.get_rank()
url = sys.argv[1]
state = {"w": torch.zeros(4), "rank_w": torch.zeros(2)}
reader = FtrtStorageReader(url)
start = reader.step or 0
if reader.step is not None:
    dcp.load(state, storage_reader=reader)
for step in range(start + 1, start + 4):
    state["w"] += 1
    dcp.save(state, storage_writer=FtrtStorageWriter(url, step))
print(f"rank {rank} from {start} w {state['w'].tolist()}", flush=True)
dist.destroy_process_group()
"""


def test_two_ranks_under_ftrt_launch_commit_move_the_job_pointer_and_resume(tmp_path, etcd_endpoint, job_id):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    url = str(tmp_path / "ck")
    for job in (f"{job_id}-a", job_id):  # the second job resumes from the first one's newest commit
        res = subprocess.run(
            [sys.executable, "-m", "ftrt.cli.main", "launch", "--etcd", etcd_endpoint, "--job-id", job,
             "--nproc-per-node", "2", "--warm-import", "torch", str(script), url],
            capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 0 from 3 w [6.0, 6.0, 6.0, 6.0]" in res.stdout + res.stderr

    ptr = latest_record(etcd_endpoint, job_id)
    assert ptr["step"] == 6 and ptr["url"] == url
    manifest = json.loads((tmp_path / "ck" / step_dir(6) / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["round"] == ptr["round"]
