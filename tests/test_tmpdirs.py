"""Temporary folders held by their owner (``ftrt.tmpdirs``): a killed owner's folder goes at the
next sweep, a living owner's stays even where its pid cannot be seen (another PID namespace)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ftrt.tmpdirs import abandoned, owned_dir, remove, sweep
from tests.agents.harness import wait_until

HOLDER = """
import sys, time
from ftrt.tmpdirs import owned_dir
print(owned_dir("ftrt-test-", sys.argv[1]), flush=True)
time.sleep(600)
"""


def _holder(root: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_a_living_owners_folder_stays_even_under_a_pid_nobody_has_and_a_killed_ones_goes(tmp_path):
    proc, folder = _holder(tmp_path)
    try:
        # as seen from another PID namespace: the pid in the name means nothing here
        hidden = folder.with_name("ftrt-test-999999999-x")
        folder.rename(hidden)
        time.sleep(1.2)  # older than a folder whose owner may not have locked it yet
        assert sweep("ftrt-test-", str(tmp_path)) == [] and hidden.exists()
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: abandoned(hidden), 10, "the killed owner's lock to be free")
    assert sweep("ftrt-test-", str(tmp_path)) == [str(hidden)] and not hidden.exists()


def test_own_folders_are_never_swept_and_remove_lets_go(tmp_path):
    mine = owned_dir("ftrt-test-", str(tmp_path))
    time.sleep(1.2)
    assert sweep("ftrt-test-", str(tmp_path)) == [] and Path(mine).is_dir()
    (tmp_path / "ftrt-test-1-nolock").mkdir()  # not made by owned_dir: never taken for abandoned
    assert sweep("ftrt-test-", str(tmp_path)) == []
    remove(mine)
    assert not Path(mine).exists()
