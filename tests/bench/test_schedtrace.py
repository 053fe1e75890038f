"""The scheduler-trace attribution of ``python -m bench overhead --sched-trace`` on a written trace."""

from __future__ import annotations

import pytest

from bench import schedtrace
from bench.overhead import mean_sched, render

TRACE = """\
# tracer: nop
          python-100     [000] d..2.    10.000000: sched_switch: prev_comm=python prev_pid=100 prev_prio=120 prev_state=R ==> next_comm=etcd next_pid=200 next_prio=120
            etcd-200     [000] d..2.    10.001000: sched_switch: prev_comm=etcd prev_pid=200 prev_prio=120 prev_state=S ==> next_comm=python next_pid=100 next_prio=120
          python-100     [000] d..2.    10.500000: sched_switch: prev_comm=python prev_pid=100 prev_prio=120 prev_state=S ==> next_comm=swapper/0 next_pid=0 next_prio=120
          <idle>-0       [000] d..2.    10.600000: sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=python next_pid=100 next_prio=120
          python-100     [000] d..2.    11.000000: sched_switch: prev_comm=python prev_pid=100 prev_prio=120 prev_state=R+ ==> next_comm=python next_pid=101 next_prio=120
          python-101     [000] d..2.    11.002000: sched_switch: prev_comm=python prev_pid=101 prev_prio=120 prev_state=S ==> next_comm=python next_pid=100 next_prio=120
     kworker/1:2-300     [001] d..2.    11.002000: sched_switch: prev_comm=kworker/1:2 prev_pid=300 prev_prio=120 prev_state=I ==> next_comm=swapper/1 next_pid=0 next_prio=120
"""
GROUPS = {100: schedtrace.WORKER, 101: "worker threads", 200: "etcd"}


def test_parse_reads_switches_and_whether_the_task_left_runnable():
    sw = schedtrace.parse(TRACE)
    assert len(sw) == 7
    assert sw[0] == schedtrace.Switch(cpu=0, t=10.0, prev_tid=100, prev_runnable=True, next_tid=200)
    assert not sw[2].prev_runnable and sw[4].prev_runnable  # "S" blocked, "R+" preempted
    assert sw[6].cpu == 1


def test_attribute_counts_only_preemptions_of_worker_main_threads():
    got = schedtrace.attribute(schedtrace.parse(TRACE), GROUPS)
    assert got["seconds"] == 1.0  # 10.000 to 11.002, rounded
    # Preempted by etcd for 1 ms and by a worker thread for 2 ms; blocking (S) is not preemption.
    assert got["preemptions_per_s_by"] == {"etcd": 1.0, "worker threads": 1.0}
    assert got["worker_preempted_ms_per_s"] == pytest.approx(3.0, abs=0.01)
    assert got["cpu_ms_per_s_by"]["etcd"] == pytest.approx(1.0, abs=0.01)
    assert got["cpu_ms_per_s_by"]["worker threads"] == pytest.approx(2.0, abs=0.01)
    assert got["cpu_ms_per_s_by"][schedtrace.WORKER] == pytest.approx(899.0 / 1.002, abs=0.01)  # 10.001-10.5 and 10.6-11.0
    assert "other" not in got["cpu_ms_per_s_by"]  # the kworker ran before the trace's first switch on cpu 1


def test_attribute_refuses_an_empty_trace():
    with pytest.raises(ValueError, match="fewer than two context switches"):
        schedtrace.attribute(schedtrace.parse("# tracer: nop\n"), GROUPS)


def test_mean_over_runs_counts_a_missing_group_as_zero_and_renders():
    a = schedtrace.attribute(schedtrace.parse(TRACE), GROUPS)
    b = {**a, "preemptions_per_s_by": {"etcd": 3.0}, "worker_preempted_ms_per_s": 5.0}
    m = mean_sched([a, b])
    assert m["preemptions_per_s_by"] == {"etcd": 2.0, "worker threads": 0.5}
    assert m["worker_preempted_ms_per_s"] == 4.0
    summary = {"torchrun": {"median_step_s": 0.4, "runs": [0.4], "sched": m}}
    assert "preempted 4.0 ms/s" in render(summary) and "etcd 2" in render(summary)
