"""The ``ftrt launch`` / ``ftrt status`` command lines: parsing, bad input, standalone mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ftrt.agents.cli import parse_launch_args
from ftrt.agents.launch_flags import parse_nnodes
from ftrt.errors import ConfigError
from tests.agents.harness import FAST_WARM, Node, Progress, ddp_args, wait_until


def run_ftrt(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftrt.cli.main", *args], capture_output=True, text=True, timeout=timeout
    )


def test_torchrun_aliases_map_onto_the_config(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    cfg = parse_launch_args([
        "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv_id", "run7", "--nproc_per_node", "4",
        "--nnodes", "2:8", "--max_restarts", "5", "--rdzv-backend", "c10d", str(script), "--lr", "3",
    ])
    assert cfg.etcd == "127.0.0.1:2379" and cfg.job_id == "run7" and cfg.nproc_per_node == 4
    assert (cfg.min_nodes, cfg.max_nodes, cfg.max_restarts) == (2, 8, 5)
    assert cfg.script == str(script) and cfg.script_args == ("--lr", "3")
    mod = parse_launch_args(["--standalone", "-m", "ftrt.examples.ddp_steps", "--steps", "3"])
    assert mod.module == "ftrt.examples.ddp_steps" and mod.script_args == ("--steps", "3")


@pytest.mark.parametrize("text,expect", [("3", (3, 3)), ("1:4", (1, 4))])
def test_nnodes_parses(text, expect):
    assert parse_nnodes(text) == expect


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--etcd", "127.0.0.1:2379", "--nnodes", "3:1", "x.py"], "MIN above MAX; write it as 1:3"),
        (["--etcd", "127.0.0.1:2379", "--nnodes", "two", "x.py"], "is not N or MIN:MAX"),
        (["--etcd", "127.0.0.1:2379", "does_not_exist.py"], "does not exist"),
        (["-m", "ftrt.examples.ddp_steps"], "pass --etcd HOST:PORT"),
        (["--etcd", "127.0.0.1:2379", "--node-id", "a/b", "-m", "x"], "starting with a letter or digit.\n"),
        (["--etcd", "127.0.0.1:2379", "--lease-ttl", "0.1", "-m", "x"], "lease-ttl=0.1"),
        (["--etcd", "127.0.0.1:2379"], "Give the training script"),
        (["--standalone", "-m", "no_such_module"], "-m no_such_module: no module 'no_such_module' here"),
        (["--standalone", "--nnodes", "2", "-m", "ftrt.examples.ddp_steps"], "--standalone runs one node"),
        (["--standalone", "tests"], "the script 'tests' is a folder, not a Python file"),
    ],
)
def test_bad_launch_input_is_one_clear_line_without_traceback(argv, needle):
    res = run_ftrt("launch", *argv, timeout=30)
    assert res.returncode != 0
    assert needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("command", ["launch", "status", "drain", "etcd", "ckpt", "chaos", "grpo", "rollout", "demo",
                                     "rollout serve", "chaos storm"])
def test_every_command_has_argparse_help_under_its_own_name_without_markup(command):
    res = run_ftrt(*command.split(), "--help", timeout=60)
    assert res.returncode == 0 and res.stdout.startswith(f"usage: ftrt {command} "), res.stdout[:300]
    assert "``" not in res.stdout and ":func:" not in res.stdout and ":class:" not in res.stdout, res.stdout


def test_config_error_names_field_and_value():
    with pytest.raises(ConfigError) as err:
        parse_launch_args(["--etcd", "h:1", "--nproc-per-node", "0", "-m", "x"])
    assert "nproc-per-node=0" in str(err.value)


def test_unreachable_etcd_fails_within_a_bounded_time():
    t0 = time.monotonic()
    res = run_ftrt("launch", "--etcd", "127.0.0.1:1", "--no-warm", "-m", "ftrt.examples.ddp_steps", timeout=60)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    assert "Cannot reach etcd at 127.0.0.1:1 within 5 s" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert elapsed < 20


def test_standalone_runs_a_job_and_stops_its_etcd(tmp_path):
    progress = Progress(tmp_path / "p.jsonl")
    res = run_ftrt("launch", "--standalone", "--nproc-per-node", "2", *FAST_WARM,
                   *ddp_args(progress.path, steps=10), timeout=120)
    assert res.returncode == 0, res.stderr
    assert {x["world"] for x in progress.lines()} == {2}
    assert "standalone: embedded etcd on" in res.stderr
    endpoint = res.stderr.split("embedded etcd on ")[1].split()[0]
    import socket

    host, port = endpoint.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()


def test_status_shows_members_round_workers_and_events(tmp_path, etcd_endpoint, job_id):
    progress = Progress(tmp_path / "p.jsonl")
    nodes = [
        Node(tmp_path, nid, ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "2", *FAST_WARM,
                             *ddp_args(progress.path, steps=400)]).start()
        for nid in ("s0", "s1")
    ]
    try:
        wait_until(lambda: progress.stepping(world=2, ranks=2), 60, "job stepping")
        wait_until(lambda: run_ftrt("status", "--etcd", etcd_endpoint, "--job-id", job_id, "--json").stdout
                   .count('"step"') >= 2, 20, "workers reporting steps")
        res = run_ftrt("status", "--etcd", etcd_endpoint, "--job-id", job_id, "--json")
        st = json.loads(res.stdout)
        assert st["state"] == "running" and st["world_size"] == 2
        assert {m["node_id"] for m in st["round"]["members"]} == {"s0", "s1"} == set(st["nodes"])
        steps = [w["step"] for ws in st["workers"].values() for w in ws if w.get("rank", -1) >= 0]
        assert len(steps) == 2 and min(steps) >= 0
        assert any(e["kind"] == "round" for e in st["events"])
        text = run_ftrt("status", "--etcd", etcd_endpoint, "--job-id", job_id).stdout
        assert "round 1: world size 2" in text and "members (rank order)" in text
    finally:
        for n in nodes:
            n.cleanup()


def test_status_of_unknown_job_says_so(etcd_endpoint):
    res = run_ftrt("status", "--etcd", etcd_endpoint, "--job-id", "no-such-job")
    assert res.returncode != 0 and f"No job 'no-such-job' in etcd at {etcd_endpoint}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("command,seconds", [(["status"], 3), (["drain", "a"], 3), (["rollout", "serve"], 5)])
def test_every_command_says_the_same_when_etcd_is_unreachable(command, seconds):
    res = run_ftrt(*command, "--etcd", "127.0.0.1:1", "--job-id", "j", timeout=60)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert f"ftrt: error: Cannot reach etcd at 127.0.0.1:1 within {seconds} s. Start etcd there (ftrt etcd) or fix " \
           "--etcd." in res.stderr, res.stderr


@pytest.mark.parametrize("argv,needle", [
    (["status", "--job-id", "j", "--etcd", "127.0.0.1:99999"], "has port 99999, which is not a port; give one of 1-65535"),
    (["ckpt", "ls", "/nonexistent/ck"], "There is no folder /nonexistent/ck (from /nonexistent/ck): nothing to list."),
    (["grpo", "steps=abc"], "ftrt grpo: error: Config field 'steps' = 'abc' is invalid"),
])
def test_typos_in_other_commands_are_one_clear_line(argv, needle):
    res = run_ftrt(*argv, timeout=60)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_runtime_outside_ftrt_is_a_world_of_one():
    code = (
        "import ftrt; rt = ftrt.init(); rt.heartbeat(3);"
        "print(rt.rank, rt.world_size, rt.launched_by_ftrt, rt.last_step, rt is ftrt.init())"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("FTRT_", "RANK", "WORLD"))}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.stdout.split() == ["0", "1", "False", "3", "True"]


def test_ftrt_etcd_serves_until_interrupted():
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "ftrt.cli.main", "etcd", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "etcd is serving on https://127.0.0.1:" in line  # closed by default (tests/store/test_closed_etcd.py)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(15) == 0


@pytest.mark.parametrize("argv,needle", [
    (["--port", "99999"], "argument --port: 99999 is not a port number: give 1-65535, or 0 for a free one"),
    (["--port", "0", "--peer-port", "x"], "argument --peer-port: 'x' is not a port number"),
    (["--port", "0", "--tls", "/proc/no/such"], "--tls /proc/no/such: cannot make or read the certificates there"),
])
def test_bad_ftrt_etcd_input_is_one_clear_line(argv, needle):
    res = run_ftrt("etcd", *argv, timeout=30)
    assert res.returncode != 0 and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "serving" not in res.stdout


def test_ftrt_etcd_on_a_busy_port_says_so_and_does_not_claim_to_serve():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_ftrt("etcd", "--port", str(port), timeout=30)
    assert res.returncode != 0, res.stdout
    assert f"--port {port}: etcd cannot listen on 127.0.0.1:{port}" in res.stderr, res.stderr
    assert "serving" not in res.stdout and "Traceback" not in res.stderr


FAULT_HISTORY_SCRIPT = """
import json, sys
import ftrt
rt = ftrt.init()
with open(f"{sys.argv[1]}/round{rt.round}-rank{rt.rank}.json", "w") as f:
    json.dump({"faults": rt.faults, "mtbf": rt.mtbf, "job_started": rt.job_started}, f)
if rt.round == 1 and rt.rank == 1:
    sys.exit(3)  # one worker failure: the next round is a fault round
"""


def test_workers_learn_the_configured_mtbf_and_the_jobs_fault_history(tmp_path):
    script = tmp_path / "history.py"
    script.write_text(FAULT_HISTORY_SCRIPT)
    t0 = time.time()
    res = run_ftrt("launch", "--standalone", "--nproc-per-node", "2", "--mtbf", "90", "--max-restarts", "1",
                   "--no-warm", str(script), str(tmp_path), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("round*-rank*.json")}
    assert seen["round1-rank0"]["faults"] == 0 and seen["round2-rank0"]["faults"] == 1, seen
    assert {s["mtbf"] for s in seen.values()} == {90.0}
    started = {s["job_started"] for s in seen.values()}
    assert len(started) == 1 and t0 <= started.pop() <= time.time()  # the first round's time, kept


WARM_CHECK_SCRIPT = """
import json, os, sys
from pathlib import Path
Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(
    {"checkpointer": "ftrt.checkpoint.checkpointer" in sys.modules, "dcp": "torch.distributed.checkpoint" in sys.modules}))
"""


def test_a_warm_worker_starts_with_the_checkpointer_imported_and_its_start_can_be_traced(tmp_path):
    script = tmp_path / "warm.py"
    script.write_text(WARM_CHECK_SCRIPT)
    trace = tmp_path / "trace.jsonl"
    res = subprocess.run([sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FTRT_DIAG_TRACE": str(trace)})
    assert res.returncode == 0, res.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen == [{"checkpointer": True, "dcp": True}] * 2  # imported by the spare, before the assignment
    marks = [json.loads(line) for line in trace.read_text().splitlines()]
    # Only the assignments: a busy machine may also trace a slow garbage collection ("gc").
    assert sorted((m["event"], m["rank"]) for m in marks if m["event"] != "gc") == [("assigned", "0"), ("assigned", "1")]


def test_a_sigkilled_standalone_launch_leaves_nothing_the_next_launch_does_not_remove(tmp_path):
    import tempfile
    from pathlib import Path

    from ftrt.procs import alive, descendants
    from ftrt.tmpdirs import owner

    script = tmp_path / "forever.py"
    script.write_text("import time\nwhile True: time.sleep(1)\n")
    log = open(tmp_path / "agent.log", "wb")
    agent = subprocess.Popen([sys.executable, "-m", "ftrt.cli.main", "launch", "--standalone", "--no-warm",
                              str(script)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "round 1: started ranks" in (tmp_path / "agent.log").read_text(), 120, "the job's start")
        tree = descendants(agent.pid)
        mine = [p for root in (tempfile.gettempdir(), "/dev/shm") for p in Path(root).glob("ftrt-*")
                if owner(p.name, p.name[:p.name.index("-", 5) + 1]) == agent.pid]
        assert {p.name.split("-")[1] for p in mine} == {"agent", "mem", "etcd"}, mine  # run folder, memory, etcd
    finally:
        agent.kill()  # SIGKILL: the agent cleans nothing up
        agent.wait()
        log.close()

    wait_until(lambda: not any(alive(p) for p in tree), 30, "the agent's etcd and workers to die with it")
    res = run_ftrt("launch", "--standalone", "--no-warm", "-m", "ftrt.examples.ddp_steps", "--steps", "2",
                   "--step-time", "0.01", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not [p for p in mine if p.exists()], mine  # the next launch swept the killed one's folders


def test_a_node_waiting_for_others_says_what_it_waits_for(tmp_path, etcd_endpoint, job_id):
    node = Node(tmp_path, "a", ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "2", "--no-warm", "-m",
                                "ftrt.examples.ddp_steps"]).start()
    try:
        wait_until(lambda: "waiting" in node.log() and "for the job's first round" in node.log(), 60,
                   "a line saying what the node waits for")
    finally:
        node.cleanup()
    line = next(x for x in node.log().splitlines() if "for the job's first round" in x)
    assert f"job '{job_id}' runs with 2 to 2 nodes (--nnodes)" in line and "fails after 600 s (--join-timeout)" in line
