"""Errors no restart can mend: which exceptions count, and a job whose script has one fails after
one start, with the reason in one line, instead of spending its restart budget."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ftrt.agents.workers import unfixable


def _raised(source: str, tmp_path) -> BaseException:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(source))
    import runpy

    try:
        runpy.run_path(str(path), run_name="__main__")
    except BaseException as exc:  # noqa: BLE001 - the point is to look at it
        return exc
    raise AssertionError("the script did not raise")


def test_import_syntax_and_usage_errors_are_unfixable_and_say_where(tmp_path):
    why = unfixable.explain(_raised("import os\nimport no_such_module_here\n", tmp_path))
    assert why == f"ModuleNotFoundError: No module named 'no_such_module_here' (at {tmp_path}/user_script.py, line 2)"
    why = unfixable.explain(_raised("from os import no_such_name\n", tmp_path))
    assert why.startswith("ImportError: cannot import name 'no_such_name' from 'os'") and "line 1)" in why
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\n\ndef f(:\n    pass\n")
    why = unfixable.explain(_raised(f"import runpy\nrunpy.run_path({str(broken)!r})\n", tmp_path))
    assert why == f"SyntaxError: invalid syntax (in {broken}, line 3)", why
    # code compiled at run time (a reward function's generated code) is not the script's
    assert unfixable.explain(_raised("exec('def f(:\\n  pass')\n", tmp_path)) is None
    why = unfixable.explain(_raised("import argparse\nargparse.ArgumentParser().parse_args(['--x'])\n", tmp_path))
    assert why.startswith("a command-line usage error")


@pytest.mark.parametrize("exc", [RuntimeError("NCCL timeout"), OSError("disk full"), SystemExit(1), SystemExit(0),
                                 SystemExit(None), KeyboardInterrupt(), MemoryError()])
def test_errors_a_restart_may_pass_are_not_unfixable(exc):
    assert unfixable.explain(exc) is None


def test_the_note_travels_beside_the_error_file_and_a_missing_one_reads_as_none(tmp_path):
    error_file = str(tmp_path / "errors" / "round-2" / "rank-1.json")
    assert unfixable.read_note(error_file) is None
    unfixable.write_note(error_file, "ModuleNotFoundError: No module named 'x'\n")
    assert unfixable.read_note(error_file) == "ModuleNotFoundError: No module named 'x'"
    assert unfixable.note_path(error_file).endswith("round-2/rank-1.unfixable")


@pytest.mark.parametrize("source,args,needle,code", [
    ("import os\nimport no_such_module_here\n", [], "ModuleNotFoundError: No module named 'no_such_module_here'", 1),
    ("def f(:\n    pass\n", [], "SyntaxError: invalid syntax", 1),
    ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--n', type=int)\np.parse_args()\n",
     ["--n", "x"], "a command-line usage error", 2),
])
def test_a_script_that_cannot_run_fails_the_job_after_one_start(tmp_path, source, args, needle, code):
    script = tmp_path / "train.py"
    script.write_text(source)
    res = subprocess.run(
        [sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", "2", "--no-warm",
         "--max-restarts", "3", str(script), *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ftrt: error: The job failed: workers failed on ") and needle in last, last
    assert "no restart can mend" in last and "fix that and launch the job again" in last
    assert f"exited with code {code}" in last
    assert "asking for a restart" not in res.stderr and "round 2" not in res.stderr, res.stderr[-3000:]
    # Each of the two workers ran once: the script's own error appears at most once per rank.
    assert res.stderr.count("[rank0]: Traceback") <= 1 and res.stderr.count("[rank1]: Traceback") <= 1


def test_the_same_error_after_the_worker_got_going_is_restarted_like_any_failure(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import ftrt\nftrt.init().heartbeat(0)\nimport no_such_module_here\n")
    res = subprocess.run(
        [sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--no-warm", "--max-restarts", "1",
         str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "asking for a restart" in res.stderr and "restart budget of 1 restarts is spent" in res.stderr
    assert "no restart can mend" not in res.stderr
