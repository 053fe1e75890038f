"""ftrt.integrations.monarch: the elastic group with its node hosts on Monarch process meshes on this
machine, with a host's process killed (its node lost) while the group trains, and a node added.

The same checks as the Ray group's (tests/integrations/test_ray.py): every sample of every step
trained once (the ledger), every step applied once, the weights those steps give, and the
survivors' worker processes kept across the round change.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

pytest.importorskip("monarch.actor", reason="torchmonarch is not installed (pip install 'ftrt[monarch]')")

from ftrt.chaos.local import wait_until  # noqa: E402
from ftrt.integrations.monarch import GroupError, MonarchGroup  # noqa: E402
from tests.integrations.groupkit import (WORKER, batch, check_after_mid_step_loss, check_ledger, lose_a_node_mid_step, pids,  # noqa: E402
                                         reference_weights, train_until_joined)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def host_pids(group) -> dict[str, int]:
    return {st["node_id"]: st["host_pid"] for st in group.status()}


def test_a_node_lost_between_steps_and_one_added_leave_every_sample_trained_once():
    with MonarchGroup(WORKER, nodes=3, min_nodes=1, max_nodes=3) as group:
        assert group.world_size == 3
        before = pids(group)
        results = [group.call("train", s, batch(s)) for s in range(3)]
        with pytest.raises(GroupError, match="steps are trained in order"):
            group.call("train", 9, batch(9))  # a method's error fails its call only
        victim = sorted(before)[1]
        os.kill(host_pids(group)[victim], signal.SIGKILL)  # the node's host process, its agent and worker
        results += [group.call("train", s, batch(s)) for s in range(3, 6)]
        assert [r.world_size for r in results] == [3] * 3 + [2] * 3
        wait_until(lambda: victim not in pids(group), 60, "the lost node dropped from the group")
        assert pids(group) == {n: p for n, p in before.items() if n != victim}  # the survivors' processes kept
        group.add_node()  # its worker warms up, then is admitted at a step's start
        train_until_joined(group, results, 3, "the added node was never admitted")
        check_ledger(results, len(results))
        weights = group.call("weights").values
        after = pids(group)
    assert {n: after[n] for n in before if n != victim} == {n: p for n, p in before.items() if n != victim}
    assert weights[0] == weights[1] == weights[2]  # the newcomer got the agreed weights
    assert torch.allclose(torch.tensor(weights[0]), reference_weights(len(results)), atol=1e-5)


def test_a_node_lost_while_a_step_is_in_flight_costs_no_sample(tmp_path):
    with MonarchGroup(WORKER, nodes=3, min_nodes=1) as group:
        hosts = host_pids(group)
        results, before, victim = lose_a_node_mid_step(group, tmp_path,
                                                       lambda node: os.kill(hosts[node], signal.SIGKILL))
        weights = check_after_mid_step_loss(group, results, before, victim)
    assert torch.allclose(torch.tensor(weights), reference_weights(6), atol=1e-5)
