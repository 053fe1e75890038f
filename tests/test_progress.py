"""ftrt.progress: bars show on a terminal (or when asked) and never garble what is printed meanwhile."""

from __future__ import annotations

from ftrt import progress


def test_auto_is_silent_off_a_terminal_and_prints_pass_through(capsys):
    with progress.bar(3, "runs", "run") as shown:
        print("result 1")
        shown.update()
    out, err = capsys.readouterr()
    assert out == "result 1\n" and err == ""
    assert not progress.shown("auto") and progress.shown("bar") and not progress.shown("none")


def test_a_shown_bar_counts_and_prints_go_above_it_as_whole_lines(capsys):
    with progress.bar(2, "runs", "run", mode="bar") as shown:
        print("first", end="")
        print(" result")
        shown.update()
        print("second result")
        shown.update()
    out, err = capsys.readouterr()
    assert out.splitlines() == ["first result", "second result"]
    assert "runs: 100%" in err and "2/2" in err
