"""``python -m bench memsave`` runs: real memory checkpoints of the goodput job's state, and the copy floor."""

from __future__ import annotations

import json

import pytest

from bench import memsave


def test_memsave_measures_real_saves_against_the_copy_floor(tmp_path):
    out = tmp_path / "memsave.json"
    assert memsave.main(["--saves", "3", "--warmup", "1", "--d-model", "16", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["saves"] == 3 and row["tensors"] > 0 and row["mb"] > 0
    assert row["cost_ms"] > 0 and row["wall_ms"] > 0 and row["copy_floor_ms"] > 0
    assert row["cost_over_floor"] == pytest.approx(row["cost_ms"] / row["copy_floor_ms"], rel=0.02, abs=0.01)
