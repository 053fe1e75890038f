"""The agent -> worker control channel (ftrt.control) on a real pipe, the worker's side of changing
rounds in place (ftrt.Runtime.step), and the agent's choice of the workers it keeps (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from ftrt import WorldChanged
from ftrt.agents.workers.env import pending_env, worker_env
from ftrt.agents.workers.keep import is_join, job_runs_in_place, keep_in_place, take_round_timeout
from ftrt.control import ControlChannel, NewRound, decode, encode
from ftrt.errors import FtrtError
from ftrt.records import Member, NodeRecord, RoundRecord
from ftrt.runtime import Runtime


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_a_new_round_travels_as_one_line_and_back():
    msg = NewRound(7, {"RANK": "3", "WORLD_SIZE": "4", "FTRT_ROUND": "7"})
    line = encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == msg
    join = NewRound(7, {"RANK": "3"}, adds_to=6)
    assert decode(encode(join)) == join and decode(encode(join)).adds_to == 6


@pytest.mark.parametrize("line", [
    b"not json", b"[]", b'{"t": "round", "round": -1, "env": {}}', b'{"t": "round", "round": true, "env": {}}',
    b'{"t": "round", "round": 2, "env": {"rank": "1"}}', b'{"t": "round", "round": 2, "env": {"RANK": 1}}',
    b'{"t": "round", "round": 2, "env": {"LD_PRELOAD=": "x"}}', b'{"t": "other", "round": 2, "env": {}}',
    b'{"t": "round", "round": 2}', b'{"t": "round", "round": 2, "env": {}, "adds_to": 2}',
    b'{"t": "round", "round": 2, "env": {}, "adds_to": "1"}', b'{"t": "round", "round": 2, "env": {}, "adds_to": -1}',
])
def test_a_malformed_message_is_ignored_not_raised(line):
    assert decode(line) is None


def test_the_newest_round_wins_and_old_ones_are_skipped(pipe):
    r, w = pipe
    ch = ControlChannel(r, after=3)
    assert ch.poll() is None
    os.write(w, encode(NewRound(3, {})) + encode(NewRound(5, {"RANK": "0"})) + encode(NewRound(4, {})))
    assert ch.poll() == NewRound(5, {"RANK": "0"})
    assert ch.take() == NewRound(5, {"RANK": "0"})
    assert ch.poll() is None  # taken: only newer rounds count now
    os.write(w, encode(NewRound(5, {})))
    assert ch.poll() is None
    half = encode(NewRound(6, {}))
    os.write(w, half[:5])
    assert ch.poll() is None  # half a line waits for the rest
    os.write(w, half[5:])
    assert ch.take() == NewRound(6, {})


def test_wait_returns_on_a_round_or_at_the_timeout_or_when_the_agent_is_gone(pipe):
    r, w = pipe
    ch = ControlChannel(r, after=0)
    assert ch.wait(0.05) is None and not ch.closed
    os.write(w, encode(NewRound(1, {})))
    assert ch.wait(5) == NewRound(1, {})
    ch.take()
    os.close(w)
    assert ch.wait(5) is None and ch.closed


def test_a_descriptor_that_is_not_a_pipe_is_not_a_channel(tmp_path):
    with open(tmp_path / "f", "w") as f:
        assert ControlChannel.open(f.fileno(), after=0) is None
    assert ControlChannel.open(987, after=0) is None


def _in_place(fd: int, timeout: float = 0.2) -> Runtime:
    return Runtime(launched_by_ftrt=True, recovery="in-place", reconfigure_timeout=timeout, round=1,
                   _control=ControlChannel(fd, after=1), _group=("gloo", {}))


def test_a_step_that_fails_on_its_own_raises_its_own_error(pipe):
    rt = _in_place(pipe[0])
    with pytest.raises(RuntimeError, match="the script's own"):
        with rt.step():
            raise RuntimeError("the script's own")


def test_a_step_that_fails_when_the_world_changed_raises_world_changed(pipe):
    r, w = pipe
    rt = _in_place(r, timeout=30)
    os.write(w, encode(NewRound(2, {"RANK": "0"})))
    # A round already waiting: the step does not start.
    with pytest.raises(WorldChanged, match="Round 2 replaced round 1"):
        with rt.step():
            raise AssertionError("the step ran although a new round was waiting")
    rt = _in_place(r, timeout=30)
    rt._control = ControlChannel(r, after=2)
    with pytest.raises(WorldChanged, match="during a step: peer gone") as info:
        with rt.step():
            os.write(w, encode(NewRound(3, {})))  # the agent's new round comes while the step fails
            raise RuntimeError("peer gone")
    assert isinstance(info.value.__cause__, RuntimeError)


def refused(rt: Runtime, match: str, **step) -> None:
    """``rt.step(**step)`` raises WorldChanged (matching ``match``) before the step runs."""
    with pytest.raises(WorldChanged, match=match):
        with rt.step(**step):
            raise AssertionError("the step ran although a new round was to be taken first")


def test_a_join_waits_for_the_step_the_ranks_agreed_on(pipe):
    r, w = pipe
    rt = _in_place(r, timeout=30)
    os.write(w, encode(NewRound(2, {"RANK": "0"}, adds_to=1)))
    assert rt.world_changed() and rt.join_waiting()
    refused(rt, "at a step boundary")  # a loop that does not agree: at once
    ran = []
    with rt.step(agreed_joins=True):  # the step runs, and its waits do not leave for the join
        assert rt._gone() is None
        ran.append(1)
    assert ran == [1]
    with rt.step(agreed_joins=True):  # still nobody agreed: the next step runs too
        rt.join_after_step()  # the step's sum said a rank saw the join
    refused(rt, "Round 2 replaced round 1 at a step boundary", agreed_joins=True)


def test_an_agreed_join_is_taken_even_before_this_rank_heard_of_it(pipe):
    r, w = pipe
    rt = _in_place(r, timeout=30)
    assert not rt.join_waiting()
    rt.join_after_step()  # a peer saw it first; the agent's line is on its way
    refused(rt, "replaced round 1 at a step boundary", agreed_joins=True)


def test_a_round_that_drops_a_member_ends_the_step_even_where_joins_wait(pipe):
    r, w = pipe
    rt = _in_place(r, timeout=30)
    os.write(w, encode(NewRound(2, {}, adds_to=1)))
    with rt.step(agreed_joins=True):
        os.write(w, encode(NewRound(3, {})))  # a fault after the join: the newest round wins
        assert not rt.join_waiting()
        assert rt._gone() == "Round 3 replaced round 1"
    refused(rt, "Round 3 replaced round 1", agreed_joins=True)
    stale = _in_place(r, timeout=30)
    stale._control = ControlChannel(r, after=3)
    stale.round = 3
    os.write(w, encode(NewRound(5, {}, adds_to=4)))  # adds to a round this worker never took
    assert not stale.join_waiting()


def test_a_join_is_a_round_with_every_member_and_no_fault_between():
    a, b, c = (Member(n, "i1", 1) for n in "abc")
    assert is_join([a, b], [a, b, c], faults_between=0)
    assert not is_join([a, b], [a, c], faults_between=0)  # b drained
    assert not is_join([a, b], [a, b, c], faults_between=1)  # a fault between: a peer was lost
    assert not is_join([a, b], [a, Member("b", "i2", 1), c], faults_between=0)  # b came back anew
    assert not is_join([], [a], faults_between=0)


def test_a_worker_kept_at_a_join_has_two_steps_to_take_it_before_it_is_replaced():
    assert take_round_timeout(10.0, 60.0, join=False) == 10.0  # a fault: --reconfigure-timeout
    assert take_round_timeout(10.0, 60.0, join=True) == 120.0  # a join: the step in flight and the next
    assert take_round_timeout(300.0, 60.0, join=True) == 300.0


def test_outside_in_place_a_step_only_runs_it():
    rt = Runtime(launched_by_ftrt=True, recovery="restart")
    with pytest.raises(RuntimeError, match="boom"):
        with rt.step():
            raise RuntimeError("boom")
    assert not rt.world_changed()


@dataclass
class W:
    local_rank: int
    in_place: bool = True
    exit_code: int | None = None
    stopping: bool = False
    hosts_store: bool = False
    done_at: float | None = None


def test_the_live_workers_are_kept_and_the_dead_replaced():
    a, b, c = W(0, hosts_store=True), W(1, exit_code=1), W(2)
    assert keep_in_place([a, b, c], nproc=3, recovery="in-place", holds_store=True) == {0: a, 2: c}


@pytest.mark.parametrize("workers, holds_store, why", [
    ([W(0), W(1, in_place=False)], False, "a live worker that does not change rounds in place"),
    ([W(0, exit_code=1), W(1, exit_code=-9)], False, "none alive"),
    ([W(0, done_at=1.0), W(1)], False, "one is finishing"),
    ([W(0, hosts_store=False), W(1)], True, "local rank 0 holds no store but this node serves it"),
    ([W(0, stopping=True), W(1, stopping=True)], False, "all being stopped"),
])
def test_every_worker_is_replaced_when(workers, holds_store, why):
    assert keep_in_place(workers, nproc=2, recovery="in-place", holds_store=holds_store) == {}, why


def test_restart_mode_keeps_nobody():
    assert keep_in_place([W(0, hosts_store=True)], nproc=1, recovery="restart", holds_store=True) == {}


def test_a_worker_started_before_admission_waits_warm_for_its_first_round(pipe, monkeypatch):
    """A pending worker (its node joins a job running in place) says it is ready at
    rt.init_process_group, then takes the round that admits its node from the control pipe and
    makes that round's group: its rank and world come only then."""
    import threading

    import torch.distributed as dist

    from ftrt import reports

    r, w = pipe
    report_r, report_w = os.pipe()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    new_env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
               "FTRT_ROUND": "4", "FTRT_ADMISSION": ""}
    for name in new_env:  # restored after the test: the worker writes them into os.environ
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    rt = Runtime(launched_by_ftrt=True, recovery="in-place", pending=True, _report_fd=report_w,
                 _control=ControlChannel(r, after=0))
    joined = threading.Thread(target=rt.init_process_group, args=("gloo",))
    joined.start()
    said = reports.decode(os.read(report_r, 4096).splitlines()[0])
    assert said == reports.InPlace() and joined.is_alive(), "it must wait, warm, for its round"
    assert not dist.is_initialized()
    os.write(w, encode(NewRound(4, new_env)))
    joined.join(30)
    try:
        assert not joined.is_alive()
        assert (rt.rank, rt.world_size, rt.round, rt.pending) == (0, 1, 4, False)
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert reports.decode(os.read(report_r, 4096).splitlines()[0]) == reports.Reconfigured(4)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.close(report_r)
        os.close(report_w)


def test_a_pending_worker_whose_agent_is_gone_says_so(pipe):
    r, w = pipe
    os.close(w)
    rt = Runtime(launched_by_ftrt=True, recovery="in-place", pending=True, _control=ControlChannel(r, after=0))
    with pytest.raises(FtrtError, match="closed its control pipe before its node was admitted"):
        rt.init_process_group("gloo")


def _record(node_id: str, **kw) -> NodeRecord:
    return NodeRecord(node_id=node_id, incarnation="i", host="h", agent_addr="a:1", nproc=1, **kw)


@pytest.mark.parametrize("records, expected", [
    ([_record("a", in_place=True)], True),
    ([_record("a"), _record("b", in_place=True)], True),
    ([_record("a")], False),
    ([_record("me", in_place=True)], False),  # its own (an earlier incarnation's) record says nothing
    ([_record("a", in_place=True, leaving=True)], False),
    ([_record("a", in_place=True, done_round=3)], False),
])
def test_a_joining_node_starts_early_only_when_another_node_runs_in_place(records, expected):
    assert job_runs_in_place(records, "me") is expected


def test_a_pending_worker_knows_its_place_on_the_node_but_not_in_the_round():
    job = dict(node_id="n0", local_rank=1, local_world_size=2, job_id="j", max_restarts=0, agent_addr="h:1")
    pending = pending_env(**job)
    assert pending["FTRT_ADMISSION"] == "pending" and pending["LOCAL_RANK"] == "1"
    assert not any(pending[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    assert pending["FTRT_ROUND"] == "0"  # an agent's own FTRT_ROUND (it runs inside a job) never hides round 1
    assert pending["FTRT_MIN_NODES"] == "1" and pending_env(**job, min_nodes=3)["FTRT_MIN_NODES"] == "3"
    rnd = RoundRecord(round=5, members=(Member("n1", "i", 1), Member("n0", "i", 2)))
    env = worker_env(rnd, master_addr="127.0.0.1", master_port=1, **job)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["FTRT_ADMISSION"]) == ("2", "3", "2", "")
    with pytest.raises(ValueError, match="local rank 3 is outside 0..1"):
        pending_env(**{**job, "local_rank": 3})
