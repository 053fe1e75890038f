"""The Checkpointer in one process: round trips, staging semantics, corruption, retention, S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ftrt.checkpoint import Checkpointer
from ftrt.checkpoint.storage import list_steps, parse_url, step_dir
from ftrt.errors import CheckpointCorrupt, CheckpointSaveFailed, CheckpointUnavailable, ConfigError


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {
        "model": model, "optim": opt, "step": 3, "buf": torch.arange(6.0),
        "meta": {"prompts_done": [1, 2, 3], "name": "run", "lr": 1e-3},
    }


class _Latest:
    """A commit fence that only limits restores to ``step`` (as the job's pointer would)."""

    round_no = 0

    def __init__(self, step: int) -> None:
        self.step = step

    def check_round(self) -> None:
        pass

    def commit(self, step: int) -> None:
        pass

    def latest(self) -> int | None:
        return self.step


def fresh_state() -> dict:
    s = make_state(seed=99)
    s.update(step=0, buf=torch.zeros(6), meta={"prompts_done": [], "name": "", "lr": 0.0})
    return s


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_restores_modules_optimizer_tensors_and_plain_values(tmp_path):
    src = make_state()
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(3, src).wait()
        dst = fresh_state()
        assert ck.restore(dst) == 3
    assert same_params(src["model"], dst["model"])
    assert torch.equal(dst["buf"], torch.arange(6.0))
    assert dst["step"] == 3 and dst["meta"] == {"prompts_done": [1, 2, 3], "name": "run", "lr": 1e-3}
    a, b = src["optim"].state_dict(), dst["optim"].state_dict()
    for k in a["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a["state"][k][name], b["state"][k][name])


def test_no_checkpoint_restores_nothing(tmp_path):
    with Checkpointer(str(tmp_path / "empty")) as ck:
        assert ck.restore(fresh_state()) is None


def test_checkpoint_keeps_the_values_of_save_time_after_in_place_mutation(tmp_path):
    src = make_state()
    with Checkpointer(str(tmp_path / "ck")) as ck:
        before = {k: v.clone() for k, v in src["model"].state_dict().items()}
        h = ck.save(5, src)
        h.wait_staged()
        with torch.no_grad():
            for p in src["model"].parameters():
                p.add_(100.0)
        src["buf"].mul_(-1)
        src["meta"]["prompts_done"].append(4)
        h.wait()
        dst = fresh_state()
        ck.restore(dst)
    for k, v in dst["model"].state_dict().items():
        assert torch.equal(v, before[k])
    assert torch.equal(dst["buf"], torch.arange(6.0)) and dst["meta"]["prompts_done"] == [1, 2, 3]


def test_staging_reuses_its_buffers_and_bounds_pending_saves(tmp_path):
    src = make_state()
    with Checkpointer(str(tmp_path / "ck"), keep=2, staging_slots=1) as ck:
        ck.save(1, src).wait()
        allocated = ck._stager.allocated_bytes
        handles = [ck.save(s, src) for s in range(2, 6)]  # one slot: each waits for the previous
        for h in handles:
            h.wait()
        assert ck._stager.allocated_bytes == allocated > 0
    assert list_steps(parse_url(str(tmp_path / "ck"))) == [4, 5]


def _corrupt(path: Path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize(
    "target,how",
    [("__0_0.distcp", "flip"), ("__0_0.distcp", "truncate"), (".metadata", "flip"),
     ("manifest.json", "truncate"), ("manifest.json", "delete"), ("__0_1.distcp", "delete")],
)
def test_damaged_newest_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, caplog, target, how):
    root = tmp_path / "ck"
    src = make_state()
    with Checkpointer(str(root), keep=5) as ck:
        ck.save(1, src).wait()
        good = {k: v.clone() for k, v in src["model"].state_dict().items()}
        with torch.no_grad():
            for p in src["model"].parameters():
                p.add_(1.0)
        ck.save(2, src).wait()
    _corrupt(root / step_dir(2) / target, how)
    dst = fresh_state()
    with Checkpointer(str(root)) as ck:
        with caplog.at_level("WARNING"):
            assert ck.restore(dst) == 1
    assert all(torch.equal(v, good[k]) for k, v in dst["model"].state_dict().items())
    assert "skipping checkpoint step-000000000002" in caplog.text


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(str(root)) as ck:
        ck.save(1, make_state()).wait()
    _corrupt(root / step_dir(1) / "__0_0.distcp", "flip")
    with Checkpointer(str(root)) as ck, pytest.raises(CheckpointCorrupt) as err:
        ck.restore(fresh_state())
    assert "step 1" in str(err.value) and "__0_0.distcp" in str(err.value) and "checksum" in str(err.value)


def test_a_verified_checkpoint_that_cannot_be_loaded_is_a_clear_error_not_a_crash(tmp_path):
    """DCP's load fails on a checkpoint that verified (here: it does not fit the state, as when the
    storage fails mid-read): DCP raises a BaseException, which the restore turns into the error a
    caller handles, naming the step and why."""
    root = tmp_path / "ck"
    with Checkpointer(str(root)) as ck:
        ck.save(1, make_state()).wait()
    other = fresh_state()
    other["buf"] = torch.zeros(7)  # the checkpoint's buf has 6 elements
    with Checkpointer(str(root)) as ck, pytest.raises(CheckpointUnavailable) as err:
        ck.restore(other)
    assert "loading checkpoint step 1" in str(err.value) and "must not train on" in str(err.value), err.value


def test_retention_keeps_the_newest_and_removes_abandoned_folders(tmp_path):
    root = tmp_path / "ck"
    src = make_state()
    with Checkpointer(str(root), keep=2) as ck:
        ck.save(1, src).wait()
        (root / step_dir(2)).mkdir()  # an abandoned, never-committed save
        (root / step_dir(2) / "__0_0.distcp").write_bytes(b"partial")
        for s in (3, 4, 5):
            ck.save(s, src).wait()
        ck._delete_pool.submit(lambda: None).result()
    assert list_steps(parse_url(str(root))) == [4, 5]


def test_saving_an_already_committed_step_is_a_no_op(tmp_path):
    src = make_state()
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(1, src).wait()
        manifest = (tmp_path / "ck" / step_dir(1) / "manifest.json").read_bytes()
        ck.save(1, src).wait()
        assert (tmp_path / "ck" / step_dir(1) / "manifest.json").read_bytes() == manifest


def test_memory_url_and_bad_input(tmp_path):
    with Checkpointer("memory://unit-test") as ck:
        ck.save(2, make_state()).wait()
        dst = fresh_state()
        assert ck.restore(dst) == 2
    with pytest.raises(ConfigError, match="unsupported scheme 'gs'"):
        Checkpointer("gs://bucket/x")
    with pytest.raises(ConfigError, match="keep=0"):
        Checkpointer(str(tmp_path), keep=0)
    with Checkpointer(str(tmp_path / "ck")) as ck:
        with pytest.raises(ConfigError, match="step must be an int >= 0"):
            ck.save(-1, make_state())
        with pytest.raises(ConfigError, match="needs the model"):
            opt = make_state()["optim"]
            ck.save(1, {"optim": opt})


def test_a_process_killed_mid_save_leaves_nothing_restore_would_load(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(str(root)) as ck:
        ck.save(1, make_state()).wait()
    script = textwrap.dedent(f"""
        import os, torch
        import ftrt.checkpoint.manifest as mf
        from ftrt.checkpoint import Checkpointer
        real = mf.checksum_file
        def stall(loc, path, *sum_kind):  # the data files are written: die before the manifest
            print("WRITTEN", flush=True)
            import time; time.sleep(60)
        mf.checksum_file = stall
        ck = Checkpointer({str(root)!r})
        big = {{"w": torch.randn(1024, 1024)}}
        ck.save(2, big).wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "WRITTEN"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (root / step_dir(2)).exists() and not (root / step_dir(2) / "manifest.json").exists()
    with Checkpointer(str(root)) as ck:
        assert ck.restore(fresh_state()) == 1


def test_cli_ls_inspect_verify(tmp_path):
    root = tmp_path / "ck"
    with Checkpointer(str(root), keep=5) as ck:
        for s in (1, 2):
            ck.save(s, make_state()).wait()

    def ftrt(*args):
        return subprocess.run([sys.executable, "-m", "ftrt.cli.main", "ckpt", *args], capture_output=True, text=True)

    out = ftrt("ls", str(root))
    assert out.returncode == 0 and "step          1  committed" in out.stdout and "step          2" in out.stdout
    insp = ftrt("inspect", str(root), "1")
    assert json.loads(insp.stdout)["step"] == 1
    assert ftrt("verify", str(root)).returncode == 0
    _corrupt(root / step_dir(2) / "__0_0.distcp", "flip")
    bad = ftrt("verify", str(root), "2")
    assert bad.returncode != 0 and "step 2" in bad.stderr and "__0_0.distcp" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert ftrt("verify", str(root), "1").returncode == 0
    missing = ftrt("verify", str(root), "7")
    assert missing.returncode != 0 and "no checkpoint step 7" in missing.stderr
    # the newest manifest damaged: verify checks the step a restore would take, and fails naming the newer one
    _corrupt(root / step_dir(2) / "manifest.json", "truncate")
    newest = ftrt("verify", str(root))
    assert newest.stdout.startswith("step 1:"), newest.stdout
    assert newest.returncode != 0 and "a restore skips them and takes step 1: step 2 is not committed (" \
        in newest.stderr, newest.stderr
    assert "Traceback" not in newest.stderr


def test_s3_round_trip(s3):
    url, opts, _ = s3
    src = make_state()
    with Checkpointer(url, storage_options=opts) as ck:
        ck.save(4, src).wait()
        dst = fresh_state()
        assert ck.restore(dst) == 4
    assert same_params(src["model"], dst["model"]) and dst["meta"] == src["meta"]


def test_s3_outage_during_save_fails_cleanly_and_the_next_save_succeeds(s3):
    url, opts, proxy = s3
    src = make_state()
    with Checkpointer(url, storage_options=opts, retries=1, retry_backoff=0.1) as ck:
        ck.save(1, src).wait()
        proxy.cut()
        h = ck.save(2, src)
        h.wait_staged()
        # Training goes on while the save fails in the background.
        for _ in range(3):
            src["model"](torch.randn(2, 8)).sum().backward()
        with pytest.raises(CheckpointSaveFailed, match="step 2 was not saved"):
            h.wait(120)
        proxy.restore()
        ck.save(3, src).wait(120)
        dst = fresh_state()
        assert ck.restore(dst) == 3
    loc = parse_url(url, opts)
    assert not loc.fs.exists(loc.path(step_dir(2), "manifest.json"))


def test_skip_if_busy_never_queues_behind_a_slow_storage_save(s3):
    """Slow storage: a save that would queue behind an unfinished one is skipped, not waited for."""
    url, opts, proxy = s3
    src = make_state()
    with Checkpointer(url, storage_options=opts, staging_slots=1) as ck:
        proxy.slow(0.3)  # every forwarded chunk +0.3 s: the first save takes seconds
        first = ck.save(1, src, skip_if_busy=True)
        first.wait_staged()
        assert not first.skipped and not first.done()
        second = ck.save(2, src, skip_if_busy=True)  # with one slot, queueing would block here
        assert second.skipped and second.done() and ck.skipped_saves == 1
        proxy.restore()
        first.wait(120)
        third = ck.save(3, src, skip_if_busy=True)  # storage idle again: saved as usual
        third.wait(120)
        assert not third.skipped
        dst = fresh_state()
        assert ck.restore(dst) == 3
    loc = parse_url(url, opts)
    assert not loc.fs.exists(loc.path(step_dir(2)))


def test_restore_during_a_storage_outage_uses_memory_or_says_storage_is_unreachable(s3, tmp_path):
    """Storage down at restore: the memory tier stands in; without one, a clear error (no crash in s3fs)."""
    url, opts, proxy = s3
    src = make_state()
    mem = tmp_path / "mem"
    with Checkpointer(url, storage_options=opts, mem_dir=str(mem)) as ck:
        ck.save(5, src).wait(120)
    proxy.cut()
    try:
        with Checkpointer(url, storage_options=opts, mem_dir=str(mem)) as ck:
            dst = fresh_state()
            assert ck.restore(dst) == 5 and ck.last_restore_tier == "memory"
        assert same_params(src["model"], dst["model"])
        with Checkpointer(url, storage_options=opts) as ck:
            with pytest.raises(CheckpointUnavailable, match="Check that the storage is reachable"):
                ck.restore(fresh_state())
    finally:
        proxy.restore()


def test_a_memory_restore_does_not_wait_for_a_hanging_storage(s3, tmp_path, caplog):
    """Storage that hangs (no answer, botocore's default retries) does not hold up a memory restore: with
    the job's pointer storage is not asked at all, and without one its listing is cut short."""
    url, opts, proxy = s3
    patient = {k: v for k, v in opts.items() if k != "config_kwargs"}  # botocore's defaults: 60 s, retries
    src = make_state()
    mem = tmp_path / "mem"
    with Checkpointer(url, storage_options=opts, mem_dir=str(mem)) as ck:
        ck.save(5, src).wait(120)
    proxy.hang()
    try:
        with Checkpointer(url, storage_options=patient, mem_dir=str(mem), fence=_Latest(5)) as ck:
            dst = fresh_state()
            with caplog.at_level("WARNING", logger="ftrt.checkpoint"):
                assert ck.restore(dst) == 5 and ck.last_restore_tier == "memory"
            assert not [r for r in caplog.records if "cannot list" in r.message]  # storage was not asked
        assert same_params(src["model"], dst["model"])
        with Checkpointer(url, storage_options=patient, mem_dir=str(mem)) as ck:
            t0 = time.monotonic()
            with caplog.at_level("WARNING", logger="ftrt.checkpoint"):
                assert ck.restore(fresh_state()) == 5 and ck.last_restore_tier == "memory"
            assert time.monotonic() - t0 < 30  # botocore alone would wait 60 s per attempt
            assert any("cannot list the checkpoints" in r.message and "did not answer" in r.message
                       for r in caplog.records), caplog.text
    finally:
        proxy.restore()


def test_skip_if_busy_skips_a_memory_checkpoint_whose_slot_is_still_being_written(s3, tmp_path):
    """Memory checkpoints every step while a slow storage save holds the other slot: skipped, never waited for."""
    url, opts, proxy = s3
    src = make_state()
    with Checkpointer(url, storage_options=opts, mem_dir=str(tmp_path / "mem"), staging_slots=2) as ck:
        proxy.slow(0.3)
        first = ck.save(1, src, skip_if_busy=True)  # to storage (slow) from one slot
        first.wait_staged()
        second = ck.save(2, src, persist=False, skip_if_busy=True)  # the other slot: fine
        second.wait()
        assert not second.skipped
        third = ck.save(3, src, persist=False, skip_if_busy=True)  # would overwrite step 2 or wait for step 1
        assert third.skipped and third.done() and not first.done()
        proxy.restore()
        first.wait(120)
    with Checkpointer(url, storage_options=opts, mem_dir=str(tmp_path / "mem")) as ck:
        assert ck.restore(fresh_state()) == 2 and ck.last_restore_tier == "memory"


def test_with_a_memory_tier_memory_checkpoints_go_on_during_a_slow_storage_save(s3, tmp_path):
    """The default third slot: every step's memory checkpoint lands while storage is still busy."""
    url, opts, proxy = s3
    src = make_state()
    with Checkpointer(url, storage_options=opts, mem_dir=str(tmp_path / "mem")) as ck:
        proxy.slow(0.3)
        first = ck.save(1, src, skip_if_busy=True)
        first.wait_staged()
        for step in range(2, 6):
            h = ck.save(step, src, persist=False, skip_if_busy=True)
            h.wait()
            assert not h.skipped
        assert not first.done() and ck.skipped_saves == 0
        proxy.restore()
        first.wait(120)
    with Checkpointer(url, storage_options=opts, mem_dir=str(tmp_path / "mem")) as ck:
        assert ck.restore(fresh_state()) == 5 and ck.last_restore_tier == "memory"
