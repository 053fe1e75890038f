"""The GRPO trainer's progress bar: tqdm's, with the reward, throughput and world size, and silent
when stderr is not a terminal (``progress=auto``)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("mode,shown", [("bar", True), ("auto", False)])
def test_the_bar_shows_progress_on_request_and_stays_quiet_in_a_log(tmp_path, mode, shown):
    res = subprocess.run([sys.executable, "-m", "ftrt.grpo", "steps=3", "prompts_per_step=4", "group_size=4",
                          f"progress={mode}", "checkpoint.url=null"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("GRPO: 100%" in res.stderr) is shown, res.stderr
    if shown:  # the final render: all steps, elapsed and left, a measured rate, the run's numbers
        final = res.stderr.rsplit("GRPO: 100%", 1)[1].splitlines()[0]
        assert re.search(r"3/3 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(step/s|s/step), reward=[\d.]+, "
                         r"tok/s=[\d,]+, world=1\]", final), final
