"""The fence watchdog: a worker process stops once its agent's deadline has passed, and not before.

The pure schedule (:func:`next_check`) is checked directly; the watchdog itself runs in a real
child process against a real fence file that the test writes as the agent would.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ftrt.agents.workers.fence import FENCED, UNSET, FenceWriter, next_check


def test_next_check_stops_on_a_fence_or_a_passed_deadline():
    assert next_check(FENCED, now=10.0, max_interval=1.0) is None
    assert next_check(9.5, now=10.0, max_interval=1.0) is None


def test_next_check_sleeps_until_just_past_the_deadline_at_most_max_interval():
    assert next_check(10.3, now=10.0, max_interval=1.0) == pytest.approx(0.301)
    assert next_check(15.0, now=10.0, max_interval=1.0) == 1.0
    assert next_check(UNSET, now=10.0, max_interval=2.0) == 2.0  # no deadline yet: poll slowly


def _watched_child(path: str, max_interval: float) -> subprocess.Popen:
    code = (
        "import sys, time\n"
        "from ftrt.agents.workers.fence import start_watchdog\n"
        f"start_watchdog({path!r}, max_interval={max_interval})\n"
        "print('watching', flush=True)\n"
        "time.sleep(60)\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "watching"
    return proc


def test_worker_lives_while_renewed_and_stops_soon_after_the_deadline(tmp_path):
    fence = FenceWriter(str(tmp_path / "fence"))
    fence.set(time.monotonic() + 0.5)
    # max_interval far beyond the test: only sleeping until the deadline can stop it in time.
    proc = _watched_child(fence.path, max_interval=30.0)
    try:
        renew_until = time.monotonic() + 2.0
        while time.monotonic() < renew_until:  # a live agent keeps moving the deadline
            fence.set(time.monotonic() + 0.5)
            time.sleep(0.1)
        assert proc.poll() is None, "the worker stopped although its deadline was being renewed"
        deadline = time.monotonic() + 0.5
        fence.set(deadline)  # the agent's last renewal
        rc = proc.wait(timeout=10)
        stopped = time.monotonic()
        assert rc == 75, proc.stderr.read()
        assert stopped >= deadline
        assert stopped - deadline < 5.0, "the watchdog waited for its maximum interval, not the deadline"
        assert "could not renew its lease in time" in proc.stderr.read()
    finally:
        proc.kill()
        fence.close()


def test_explicit_fence_stops_the_worker_within_max_interval(tmp_path):
    fence = FenceWriter(str(tmp_path / "fence"))
    fence.set(time.monotonic() + 60)
    proc = _watched_child(fence.path, max_interval=0.2)
    try:
        fence.fence()
        assert proc.wait(timeout=10) == 75
        assert "was fenced" in proc.stderr.read()
    finally:
        proc.kill()
        fence.close()
