"""The trainer's checkpoint cadence: ``auto`` saves often when failures are frequent, rarely when not."""

from __future__ import annotations

import json
import subprocess
import sys

from ftrt.checkpoint.storage import list_steps, parse_url

TINY = ["steps=25", "prompts_per_step=4", "group_size=4", "model.d_model=16", "model.n_layers=1",
        "model.n_heads=2", "progress=none", "checkpoint.keep=1000"]


def train(tmp_path, name: str, *extra: str) -> tuple[list[int], list[int], str]:
    """Steps that were saved, steps after which a storage save was due, the trainer's output."""
    url = tmp_path / name
    res = subprocess.run([sys.executable, "-m", "ftrt.grpo", *TINY, f"checkpoint.url={url}",
                          f"metrics_path={tmp_path / name}.jsonl", *extra],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    due = [x["step"] + 1 for x in lines if x["ckpt"] == "storage"]
    return list_steps(parse_url(str(url), None)), due, res.stdout


def test_auto_storage_cadence_follows_the_mtbf(tmp_path):
    saved, due, out = train(tmp_path, "frequent", "checkpoint.mtbf=0.001")
    # A failure every millisecond: a save is due after every step (one due while the last is still
    # being written is skipped, so that slow storage never stalls training).
    assert due == list(range(1, 26)), due
    assert saved[0] == 1 and saved[-1] == 25 and set(saved) <= set(due), saved
    assert "storage checkpoints every" in out and "MTBF 0 s (configured)" in out
    saved, due, out = train(tmp_path, "rare", "checkpoint.mtbf=1e9", "checkpoint.max_interval_s=1e6")
    assert saved == due == [1, 25], (saved, due)  # the first save measures the cost; the last always goes
    saved, due, _ = train(tmp_path, "fixed", "checkpoint.interval=10")
    assert due == [10, 20, 25] and set(saved) <= set(due) and saved[-1] == 25, (saved, due)


def test_the_save_after_a_step_follows_the_cadences_the_last_step_and_a_round_end():
    from ftrt.grpo.checkpointing import decide_save

    def decide(done, **kw):
        args = dict(checkpointing=True, round_ends=False, storage_due=False, memory_due=False) | kw
        d = decide_save(done, 10, **args)
        return d.tier, d.skip_if_busy

    assert decide(3) == (None, True)
    assert decide(3, memory_due=True) == ("memory", True)
    assert decide(3, storage_due=True, memory_due=True) == ("storage", True)
    assert decide(10) == ("storage", False)  # the final save: always to storage, never skipped
    # A round that ends after this step ends with a memory save, never skipped: the next round has it.
    assert decide(4, round_ends=True, storage_due=True) == ("memory", False)
    # When the next round is inactive (the job waits or stops), that save goes to storage.
    assert decide(4, round_ends=True, durable=True) == ("storage", False)
    assert decide(10, checkpointing=False, storage_due=True, memory_due=True) == (None, False)
