"""Elastic behaviour on real etcd, real agents and real worker processes (loopback).

Each test injects a fault into running agents and checks the job goes on and finishes with
nothing lost: survivors step at the new world size, progress resumes from the last completed step,
exit codes tell the truth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.harness import FAST_WARM, Node, Progress, ddp_args, wait_until

pytestmark = pytest.mark.slow


def steps_of(progress: Progress, rank: int) -> list[int]:
    return [x["step"] for x in progress.lines() if x["rank"] == rank]


def assert_no_step_lost(progress: Progress, steps: int) -> None:
    """Rank 0 of each world covers every step up to the end; restarts resume at most 1 step back."""
    seen = sorted({x["step"] for x in progress.lines() if x["rank"] == 0})
    assert seen == list(range(steps)), f"steps missing: {sorted(set(range(steps)) - set(seen))}"


@pytest.mark.parametrize("victim", ["n1", "n0"], ids=["non-master", "rank0-master"])
def test_node_loss_shrinks_the_world_and_the_job_finishes(tmp_path, make_node, victim):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=160)
    nodes = {nid: make_node(nid, script) for nid in ("n0", "n1", "n2")}
    wait_until(lambda: progress.stepping(world=3, ranks=3), 60, "three ranks stepping at world 3")
    wait_until(lambda: all(n.warm() for n in nodes.values()), 30, "warm spares")
    killed_at = nodes[victim].kill()
    first = wait_until(lambda: progress.stepping(world=2, ranks=2, since=killed_at), 30,
                       "both survivors stepping at world 2")
    survivors = [n for nid, n in nodes.items() if nid != victim]
    for n in survivors:
        assert n.wait(90) == 0, n.log()
    assert_no_step_lost(progress, 160)
    assert max(first.values()) > killed_at
    log = survivors[0].log() + survivors[1].log()
    assert f"peer {victim} is dead" in log or f"lost {victim}" in log


def test_worker_crash_restarts_the_round_and_counts_a_restart(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=60, extra=("--fail-at-step", "20", "--fail-rank", "1"))
    a = make_node("a", script, nnodes="2")
    b = make_node("b", script, nnodes="2")
    assert a.wait(90) == 0, a.log()
    assert b.wait(30) == 0, b.log()
    assert_no_step_lost(progress, 60)
    rounds = {x["round"] for x in progress.lines()}
    assert len(rounds) == 2, rounds
    assert "exited with code 1" in a.log() + b.log()


def test_restart_budget_spent_fails_the_job_with_a_clear_message(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=60, extra=("--fail-at-step", "5", "--fail-rank", "0"))
    a = make_node("a", script, nnodes="1", extra=("--max-restarts", "0"))
    rc = a.wait(60)
    assert rc != 0
    assert "restart budget of 0 restarts is spent" in a.log()
    assert "Traceback" not in a.log().split("ftrt: error:")[-1]


def test_hung_worker_is_killed_and_the_round_restarted(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=50, extra=("--hang-at-step", "15", "--fail-rank", "0"))
    a = make_node("a", script, nnodes="1", extra=("--hang-timeout", "1.5"))
    assert a.wait(90) == 0, a.log()
    assert "sent no heartbeat" in a.log()
    assert_no_step_lost(progress, 50)


def test_one_hung_worker_restarts_the_job_once_though_every_agent_sees_a_hang(tmp_path, make_node):
    """A hang stalls every rank's heartbeat (they wait in all_reduce): both agents report it, and
    the job must restart once, not once per report. (The race where a report, delayed by stopping a
    SIGSTOPped worker, restarted round 2 as well is reproduced by the freeze-worker chaos scenario.)"""
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=50, extra=("--hang-at-step", "15", "--fail-rank", "0"))
    a = make_node("a", script, nnodes="2", extra=("--hang-timeout", "3"))
    b = make_node("b", script, nnodes="2", extra=("--hang-timeout", "3"))
    assert a.wait(120) == 0, a.log()
    assert b.wait(30) == 0, b.log()
    assert_no_step_lost(progress, 50)
    assert {x["round"] for x in progress.lines()} == {1, 2}, a.log() + b.log()
    assert "sent no heartbeat" in a.log() + b.log()


def test_a_worker_that_said_it_is_done_is_not_judged_hung_during_its_teardown(tmp_path, make_node):
    """A worker's teardown (the interpreter joining threads, a long final log write) sends no heartbeats;
    after ``rt.done()`` that silence is not a hang, and the job ends once, with every worker's exit 0."""
    progress = Progress(tmp_path / "p.jsonl")
    a = make_node("a", ddp_args(progress.path, steps=10, extra=("--teardown", "4")), nnodes="1",
                  extra=("--hang-timeout", "1"))
    assert a.wait(120) == 0, a.log()
    assert "sent no heartbeat" not in a.log() and {x["round"] for x in progress.lines()} == {1}, a.log()
    assert "rank 0 is done" in a.log()


def test_a_worker_stuck_in_its_teardown_after_it_said_it_is_done_is_killed_and_the_job_succeeds(tmp_path,
                                                                                                  make_node):
    """torch's gloo process group can deadlock in its destructor at interpreter exit (seen here: the
    main thread joins a gloo thread that waits for the GIL). A worker that said it is done and does
    not exit within --teardown-timeout is killed; its work is done, so the job still succeeds."""
    progress = Progress(tmp_path / "p.jsonl")
    a = make_node("a", ddp_args(progress.path, steps=10, extra=("--teardown", "600")), nnodes="1",
                  extra=("--teardown-timeout", "2"))
    assert a.wait(120) == 0, a.log()
    assert "its teardown is stuck" in a.log() and "rank 0 said its work was done" in a.log(), a.log()
    assert [x["step"] for x in progress.lines()] == list(range(10))


def test_new_node_is_admitted_and_the_world_grows(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=250)
    make_node("a", script)
    make_node("b", script)
    wait_until(lambda: progress.stepping(world=2, ranks=2), 60, "two ranks stepping")
    c = make_node("c", script)
    wait_until(lambda: progress.stepping(world=3, ranks=3, since=c.started_at), 60, "three ranks stepping")
    assert c.wait(90) == 0, c.log()
    assert_no_step_lost(progress, 250)


def test_below_min_waits_then_starts_when_enough_nodes_arrive(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=20)
    a = make_node("a", script, nnodes="2:2")
    wait_until(lambda: a.warm(), 30, "first node warm")
    assert progress.lines() == []  # alone, below MIN: nothing runs
    b = make_node("b", script, nnodes="2:2")
    assert a.wait(60) == 0 and b.wait(30) == 0
    assert {x["world"] for x in progress.lines()} == {2}


def test_below_min_past_the_join_timeout_fails_clearly(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    a = make_node("a", ddp_args(progress.path, steps=5), nnodes="2:3", extra=("--join-timeout", "2"))
    rc = a.wait(30)
    assert rc != 0
    err = a.log().split("ftrt: error:")[-1]
    assert "only 1 of the required 2 nodes" in err and "Traceback" not in err


def test_frozen_node_is_dropped_after_its_lease_and_does_not_train_when_thawed(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=300)
    nodes = {nid: make_node(nid, script) for nid in ("n0", "n1", "n2")}
    wait_until(lambda: progress.stepping(world=3, ranks=3), 60, "three ranks stepping")
    frozen_at = nodes["n2"].freeze()
    wait_until(lambda: progress.stepping(world=2, ranks=2, since=frozen_at), 30, "survivors at world 2")
    shrunk_at = max(progress.stepping(world=2, ranks=2, since=frozen_at).values())
    stale_pids = {x["pid"] for x in progress.lines() if x["world"] == 3}
    nodes["n2"].thaw()
    # Thawed, the node fences itself (its old workers exit, never stepping again) and rejoins as a
    # new member: the world grows back to 3 with fresh workers.
    wait_until(lambda: progress.stepping(world=3, ranks=3, since=shrunk_at), 60, "world back to 3")
    late = [x for x in progress.after(shrunk_at) if x["pid"] in stale_pids and x["world"] == 3]
    assert late == [], f"a worker of the stale round stepped after the world shrank: {late[:3]}"
    assert "lost membership" in nodes["n2"].log()
    for n in nodes.values():
        assert n.wait(120) == 0, n.log()


def test_frozen_agent_stops_its_own_workers_through_the_fence(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=400)
    a = make_node("a", script, nnodes="1:2")
    b = make_node("b", script, nnodes="1:2")
    wait_until(lambda: progress.stepping(world=2, ranks=2), 60, "two ranks stepping")
    frozen_at = a.freeze(agent_only=True)
    worker_pids = a.tree()[1:]
    # With its agent frozen, a's worker exits by itself once the lease deadline (2 s) has passed.
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in _assigned(worker_pids, progress)),
               15, "the frozen agent's worker to exit")
    wait_until(lambda: progress.stepping(world=1, ranks=1, since=frozen_at), 30, "b alone at world 1")
    a.thaw()
    assert b.wait(120) == 0, b.log()


def _assigned(pids: list[int], progress: Progress) -> list[int]:
    stepping = {x["pid"] for x in progress.lines()}
    return [p for p in pids if p in stepping]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_duplicate_node_id_is_refused_without_disturbing_the_first(tmp_path, make_node):
    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=120)
    a = make_node("same", script, nnodes="1")
    wait_until(lambda: progress.stepping(world=1, ranks=1), 60, "first agent stepping")
    dup = make_node("same", script, nnodes="1")
    assert dup.wait(30) != 0
    err = dup.log().split("ftrt: error:")[-1]
    assert "already held" in err and "--node-id" in err and "Traceback" not in err
    assert a.alive()
    assert a.wait(90) == 0
    assert {x["round"] for x in progress.lines()} == {1}


def test_torchrun_script_runs_unchanged_with_the_full_environment(tmp_path, make_node):
    script = tmp_path / "plain_torchrun.py"
    out = tmp_path / "env.jsonl"
    script.write_text(
        "import json, os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "names = ['RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','GROUP_RANK','GROUP_WORLD_SIZE',\n"
        "         'ROLE_RANK','ROLE_WORLD_SIZE','MASTER_ADDR','MASTER_PORT','TORCHELASTIC_RESTART_COUNT',\n"
        "         'TORCHELASTIC_MAX_RESTARTS','TORCHELASTIC_RUN_ID','FTRT_JOB_ID','FTRT_NODE_ID','FTRT_ROUND',\n"
        "         'FTRT_AGENT_ADDR']\n"
        f"with open({str(out)!r}, 'a') as f:\n"
        "    f.write(json.dumps({**{n: os.environ.get(n) for n in names}, 'sum': t.item(),\n"
        "                        'argv': __import__('sys').argv[1:], 'name': __name__}) + '\\n')\n"
        "dist.destroy_process_group()\n"
    )
    a = make_node("a", [str(script), "--flag", "x"], nnodes="2", extra=("--nproc-per-node", "2"))
    b = make_node("b", [str(script), "--flag", "x"], nnodes="2", extra=("--nproc-per-node", "2"))
    assert a.wait(60) == 0 and b.wait(30) == 0, a.log() + b.log()
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(int(r["RANK"]) for r in rows) == [0, 1, 2, 3]
    for r in rows:
        assert r["sum"] == 10.0  # 1+2+3+4: all four ranks in one process group
        assert r["WORLD_SIZE"] == "4" and r["LOCAL_WORLD_SIZE"] == "2" and r["GROUP_WORLD_SIZE"] == "2"
        assert r["ROLE_RANK"] == r["RANK"] and r["ROLE_WORLD_SIZE"] == "4"
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * 2 + int(r["LOCAL_RANK"])
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0" and r["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert r["TORCHELASTIC_RUN_ID"] == r["FTRT_JOB_ID"] and r["FTRT_ROUND"] == "1"
        assert r["MASTER_ADDR"] == "127.0.0.1" and int(r["MASTER_PORT"]) > 0
        assert r["argv"] == ["--flag", "x"] and r["name"] == "__main__"
        assert r["FTRT_NODE_ID"] in ("a", "b") and r["FTRT_AGENT_ADDR"]


def test_etcd_leader_loss_is_a_short_pause_the_job_does_not_notice(tmp_path, etcd_cluster, job_id):
    progress = Progress(tmp_path / "p.jsonl")
    nodes = [
        Node(tmp_path, nid, ["--etcd", etcd_cluster.endpoints, "--job-id", job_id, "--nnodes", "2",
                             "--lease-ttl", "3", *FAST_WARM, *ddp_args(progress.path, steps=200)]).start()
        for nid in ("e0", "e1")
    ]
    try:
        wait_until(lambda: progress.stepping(world=2, ranks=2), 60, "job stepping")
        etcd_cluster.leader().kill()
        for n in nodes:
            assert n.wait(90) == 0, n.log()
        # No membership change, no restart: the whole job ran in its first round.
        assert {x["round"] for x in progress.lines()} == {1}
        assert_no_step_lost(progress, 200)
    finally:
        for n in nodes:
            n.cleanup()


def test_sigterm_stops_workers_cleanly_and_leaves_the_job_at_once(tmp_path, make_node, etcd_endpoint, job_id):
    import asyncio

    from ftrt.jobkeys import JobKeys
    from ftrt.store.etcd import EtcdStore

    progress = Progress(tmp_path / "p.jsonl")
    script = ddp_args(progress.path, steps=100000)
    # --drain-timeout 0: SIGTERM stops at once, as torchrun's agent does (tests/agents/test_drain.py
    # covers the default, a graceful drain)
    a = make_node("a", script, nnodes="1:2", extra=("--stop-grace", "3", "--log-dir", str(tmp_path / "logs"),
                                                    "--drain-timeout", "0"))
    wait_until(lambda: progress.stepping(world=1, ranks=1), 60, "stepping")
    workers = a.tree()[1:]
    a.proc.send_signal(15)
    assert a.wait(20) == 128 + 15
    assert not [p for p in workers if Path(f"/proc/{p}").exists() and _state(p) != "Z"]

    async def node_key():
        store = EtcdStore(etcd_endpoint)
        try:
            return (await store.get(JobKeys(job_id).node("a")))[0]
        finally:
            await store.close()

    # The lease was revoked on the way out: the node is gone now, not after its TTL.
    assert asyncio.run(node_key()) is None
    log_file = tmp_path / "logs" / "round-1" / "rank-0.log"
    assert log_file.read_text().startswith("rank 0 of 1 (round 1) starts at step 0")
    assert "[rank0]: rank 0 of 1 (round 1) starts at step 0" in a.log()  # console lines are prefixed


ENV_DUMP = (
    "import json, os, sys\n"
    "base = set(json.loads(os.environ['BASE_KEYS']))\n"
    "out = {k: v for k, v in os.environ.items() if k not in base}\n"
    "open(sys.argv[1] + '-' + os.environ['RANK'] + '.json', 'w').write(json.dumps(out))\n"
)
TORCHRUN_ONLY = {"BASE_KEYS"}
"""Names torchrun sets that a worker under ftrt does not need (none today but the test's own)."""


def test_every_variable_torchrun_sets_is_set_by_ftrt_launch_with_its_meaning(tmp_path):
    """Parity measured against the real torchrun, not a list: what Lightning, accelerate and
    torchelastic's @record read must be there."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "dump.py"
    script.write_text(ENV_DUMP)
    env = {**os.environ, "BASE_KEYS": json.dumps(list(os.environ) + ["BASE_KEYS"])}
    for name, cmd in (("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone"]),
                      ("ftrt", [sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone"])):
        res = subprocess.run([*cmd, "--nproc-per-node", "2", str(script), str(tmp_path / name)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
    for rank in ("0", "1"):
        theirs = json.loads((tmp_path / f"torchrun-{rank}.json").read_text())
        ours = json.loads((tmp_path / f"ftrt-{rank}.json").read_text())
        assert set(theirs) - TORCHRUN_ONLY <= set(ours), set(theirs) - set(ours)
        same = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")
        assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
        assert ours["TORCHELASTIC_ERROR_FILE"].endswith(f"rank-{rank}.json")


def test_a_worker_s_recorded_exception_is_named_in_the_failure(tmp_path, make_node):
    """A script wrapped in torchelastic's @record writes its exception to TORCHELASTIC_ERROR_FILE;
    the agent names it when it reports the failure."""
    script = tmp_path / "boom.py"
    script.write_text(
        "import os\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('the learning rate is a string')\n"
        "main()\n")
    node = make_node("a", [str(script)], nnodes="1", extra=("--nproc-per-node", "2", "--max-restarts", "0"))
    assert node.wait(120) != 0
    assert "exited with code 1: ValueError: the learning rate is a string" in node.log(), node.log()[-2000:]
