"""ftrt.sync_state on two real gloo ranks: the rank behind gets the state of the rank with the newest
step, and with a bounded wait a frozen peer ends the agreement in WorldChanged instead of holding it."""

from __future__ import annotations

import os
import time

import pytest

from tests.ranks import run_ranks, say

torch = pytest.importorskip("torch")


def _agree(rank: int, init: str, bounded: bool, out) -> None:
    import torch.distributed as dist

    from ftrt import sync_state

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    params = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank)]
    wait = (lambda work: work.wait()) if bounded else None
    step = sync_state(7 if rank == 1 else 6, params, wait=wait)  # rank 1 applied one more step
    dist.destroy_process_group()
    say(out, rank, (step, [p.tolist() for p in params]))


@pytest.mark.parametrize("bounded", [False, True])
def test_the_rank_behind_gets_the_newest_state(tmp_path, bounded):
    got = run_ranks(_agree, tmp_path, bounded)
    newest = (7, [[1.0, 1.0, 1.0], [[11.0, 11.0], [11.0, 11.0]]])
    assert got == {0: newest, 1: newest}


def _frozen_peer(rank: int, init: str, out) -> None:
    import torch.distributed as dist

    from ftrt import WorldChanged, sync_state
    from ftrt.inplace import wait_leaving

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:  # never joins the agreement: as a frozen peer, its sockets stay open
        say(out, rank, "frozen")
        time.sleep(3600)
    slices = []

    def gone() -> str | None:  # the agent's next round comes after a few slices of waiting
        slices.append(1)
        return "Round 3 replaced round 2" if len(slices) >= 3 else None

    t0 = time.monotonic()
    try:
        sync_state(5, [torch.zeros(4)], wait=lambda work: wait_leaving(work, gone))
    except WorldChanged as exc:
        say(out, rank, f"left after {time.monotonic() - t0:.1f} s: {exc}")
    else:
        say(out, rank, "the agreement completed without its peer")
    os._exit(0)  # the group is never freed: its threads wait on the frozen peer


def test_a_frozen_peer_ends_a_bounded_agreement_in_world_changed(tmp_path):
    said = run_ranks(_frozen_peer, tmp_path, kill=(1,))
    assert said[1] == "frozen"
    assert "Round 3 replaced round 2 while a collective waited" in said[0], said[0]


def _agree_on_a_state_dict(rank: int, init: str, out) -> None:
    import torch.distributed as dist

    from ftrt import sync_state_dict

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(rank)  # other initial weights on each rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    trainer = {"step": 0, "frontier": 0, "name": "newcomer"}
    if rank == 0:  # the running rank: two steps applied; rank 1 is a newcomer with no optimizer state
        for i in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        trainer = {"step": 2, "frontier": 16, "name": "running"}
    state = {"model": model, "optim": opt, "trainer": trainer}
    step = sync_state_dict(1 if rank == 0 else -1, state)
    said = {"step": step, "trainer": state["trainer"],
            "params": [p.detach().tolist() for p in model.parameters()],
            "adam": [[v.tolist() for v in s.values()] for s in opt.state.values()]}
    # Both go on alike: one more step gives the same weights on both.
    opt.zero_grad()
    model(torch.ones(8, 4)).pow(2).mean().backward()
    opt.step()
    said["after"] = [p.detach().tolist() for p in model.parameters()]
    dist.destroy_process_group()
    say(out, rank, said)


def test_a_newcomer_gets_the_model_the_optimizer_state_and_the_counters(tmp_path):
    got = run_ranks(_agree_on_a_state_dict, tmp_path)
    assert got[0]["trainer"] == {"step": 2, "frontier": 16, "name": "running"}
    assert got[1] == got[0], "the newcomer's state differs from the running rank's"
    assert got[1]["step"] == 1 and len(got[1]["adam"]) == 4  # AdamW state for each of 4 parameters
