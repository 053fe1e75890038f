"""ftrt.integrations.ray: an elastic group on a real Ray cluster of several raylets on this machine
(loopback only), with Ray nodes removed while it trains.

Each test checks what a fault must not change: every sample of every step trained exactly once
(the ledger of what each rank trained), every step applied once, the weights those steps give, and
the survivors' worker processes kept (same pids) across the round change.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ftrt[ray]')")

from ftrt.integrations.ray import ElasticGroup, loopback_cluster  # noqa: E402
from ftrt.chaos.local import wait_until  # noqa: E402
from tests.integrations.groupkit import (WORKER, batch, check_after_mid_step_loss, check_ledger, lose_a_node_mid_step, pids,  # noqa: E402
                                         reference_weights, train_until_joined)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]



@pytest.fixture
def cluster():
    c = loopback_cluster(3)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def node_of(cluster, group, node_id: str):
    return next(n for n in cluster.worker_nodes if f"ray-{n.node_id[:12]}" == node_id)


def test_a_node_removed_between_steps_leaves_the_survivors_training_in_place(cluster):
    with ElasticGroup(WORKER, min_nodes=1) as group:
        assert group.world_size == 3
        before = pids(group)
        results = [group.call("train", s, batch(s)) for s in range(4)]
        victim = sorted(before)[1]
        cluster.remove_node(node_of(cluster, group, victim))
        results += [group.call("train", s, batch(s)) for s in range(4, 8)]
        assert [r.world_size for r in results] == [3] * 4 + [2] * 4
        check_ledger(results, 8)
        after = pids(group)
        assert after == {n: p for n, p in before.items() if n != victim}  # the survivors' processes kept
        weights = group.call("weights").values
    assert weights[0] == weights[1]
    assert torch.allclose(torch.tensor(weights[0]), reference_weights(8), atol=1e-5)


def test_a_node_removed_while_a_step_is_in_flight_costs_no_sample(cluster, tmp_path):
    with ElasticGroup(WORKER, min_nodes=1) as group:
        results, before, victim = lose_a_node_mid_step(
            group, tmp_path, lambda node: cluster.remove_node(node_of(cluster, group, node)))
        weights = check_after_mid_step_loss(group, results, before, victim)
    assert torch.allclose(torch.tensor(weights), reference_weights(6), atol=1e-5)


def test_errors_of_one_call_fail_that_call_only_and_close_leaves_nothing_running(cluster):
    from multiprocessing.connection import AuthenticationError, Client

    from ftrt.integrations.ray import GroupError
    from ftrt.procs import alive

    with ElasticGroup(WORKER, min_nodes=1) as group:
        with pytest.raises(GroupError, match=r"(?s)train failed on rank 0 .*steps are trained in order"):
            group.call("train", 5, batch(5))
        # the driver's own code travels (cloudpickle); a value that cannot come back fails the call
        assert group.call("apply", lambda w: w.step + 10).values == (9, 9, 9)
        with pytest.raises(GroupError, match="returned a lock, which cannot be pickled"):
            group.call("apply", lambda w: threading.Lock())
        with pytest.raises(GroupError, match="has no attribute 'no_such_method'"):
            group.call("no_such_method")
        # a process without the host's key is turned away; the host serves its workers on
        socket_path = str(Path(group.status()[0]["log"]).parent / "host.sock")
        with pytest.raises(AuthenticationError):
            Client(socket_path, "AF_UNIX", authkey=b"not the key")
        assert group.call("train", 0, batch(0)).world_size == 3
        workers = [w["pid"] for st in group.status() for w in st["workers"]]
        agents = [st["agent_pid"] for st in group.status()]
    wait_until(lambda: not any(alive(p) for p in [*workers, *agents]), 60, "the group's processes gone")


def test_a_node_added_to_the_cluster_joins_at_a_step_boundary_and_trains_its_share(tmp_path):
    c = loopback_cluster(2)
    try:
        with ElasticGroup(WORKER, min_nodes=1, max_nodes=3) as group:
            before = pids(group)
            results = [group.call("train", s, batch(s)) for s in range(2)]
            c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            train_until_joined(group, results, 3, "the added node was never admitted")
            check_ledger(results, len(results))
            after = pids(group)
            assert {n: after[n] for n in before} == before and len(after) == 3  # nobody restarted
            weights = group.call("weights").values
        assert weights[0] == weights[2]  # the newcomer got the agreed weights
        assert torch.allclose(torch.tensor(weights[0]), reference_weights(len(results)), atol=1e-5)
    finally:
        ray.shutdown()
        c.shutdown()


def test_a_worker_killed_alone_is_replaced_and_gets_the_agreed_state_while_the_others_stay(cluster):
    import os
    import signal

    with ElasticGroup(WORKER, min_nodes=1) as group:
        before = pids(group)
        results = [group.call("train", s, batch(s)) for s in range(3)]
        victim = sorted(before)[2]
        os.kill(before[victim], signal.SIGKILL)
        # its agent starts a new worker; the round changes with the same nodes
        wait_until(lambda: pids(group).get(victim, before[victim]) != before[victim], 120, "a new worker")
        results += [group.call("train", s, batch(s)) for s in range(3, 6)]
        assert [r.world_size for r in results] == [3] * 6
        check_ledger(results, 6)
        after = pids(group)
        assert {n: p for n, p in after.items() if n != victim} == {n: p for n, p in before.items() if n != victim}
        weights = group.call("weights").values
    assert weights[0] == weights[1] == weights[2]
    assert torch.allclose(torch.tensor(weights[0]), reference_weights(6), atol=1e-5)


def test_a_frozen_node_is_left_behind_and_comes_back_as_a_newcomer_once_thawed(cluster):
    import os
    import signal

    from ftrt.procs import alive

    with ElasticGroup(WORKER, min_nodes=1) as group:
        before = pids(group)
        results = [group.call("train", s, batch(s)) for s in range(3)]
        victim = sorted(before)[2]
        st = next(x for x in group.status() if x["node_id"] == victim)
        frozen = [st["host_pid"], st["agent_pid"], before[victim]]
        for pid in frozen:  # the whole node stops answering (Ray still sees its raylet alive)
            os.kill(pid, signal.SIGSTOP)
        try:
            # A method without collectives: the survivors answer at once in the old round, and the call
            # ends once they are in a newer round without the frozen node (its lease ran out); the frozen
            # rank's value is missing.
            res = group.call("pid")
            assert res.world_size == 3 and len(res.missing) == 1, res
            assert sorted(v for v in res.values if v is not None) == sorted(p for n, p in before.items() if n != victim)
            # a step: the survivors run it at world 2
            results.append(group.call("train", 3, batch(3)))
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert results[-1].world_size == 2
        # thawed, the node's agent finds itself out of the job: its stale worker ends, and the node
        # joins again as a newcomer (a fresh worker that gets the agreed state at a step's start)
        wait_until(lambda: not alive(before[victim]), 120, "the thawed node's stale worker gone")
        train_until_joined(group, results, 3, "the thawed node never came back")
        check_ledger(results, len(results))
        after = pids(group)
        assert {n: after[n] for n in before if n != victim} == {n: p for n, p in before.items() if n != victim}
        assert after[victim] != before[victim]
        weights = group.call("weights").values
    assert weights[0] == weights[2]
    assert torch.allclose(torch.tensor(weights[0]), reference_weights(len(results)), atol=1e-5)
