"""RoundEndVote: two real ranks on gloo agree on the round end one step after the first rank saw
the request, whichever rank saw it, and every rank gets the same answer at every step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.ranks import run_ranks, say

torch = pytest.importorskip("torch")


@dataclass
class _Asked:
    """A runtime whose round end is asked on one rank from one step on (as the mapped file reads)."""

    rank: int
    asked_rank: int
    asked_from: int
    step: int = 0
    launched_by_ftrt: bool = True

    def round_ending(self) -> bool:
        return self.rank == self.asked_rank and self.step >= self.asked_from

    def wait(self, work) -> None:  # Runtime.wait outside in-place recovery
        work.wait()


def _rank(rank: int, init: str, asked_rank: int, out) -> None:
    import torch.distributed as dist

    from ftrt import RoundEndVote

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rt = _Asked(rank, asked_rank, asked_from=3)
    vote = RoundEndVote(rt)
    answers = []
    for step in range(6):
        rt.step = step
        answers.append(vote())
    vote.close()
    dist.destroy_process_group()
    say(out, rank, answers)


@pytest.mark.parametrize("asked_rank", [0, 1])
def test_the_ranks_agree_one_step_after_the_first_saw_the_request(tmp_path, asked_rank):
    results = run_ranks(_rank, tmp_path, asked_rank)
    expected = [False, False, False, False, True, True]  # asked at step 3: agreed at step 4
    assert results == {0: expected, 1: expected}


def test_outside_ftrt_launch_it_is_always_false_and_needs_no_process_group():
    from ftrt import RoundEndVote

    vote = RoundEndVote(_Asked(0, 0, 0, launched_by_ftrt=False))
    assert [vote() for _ in range(3)] == [False, False, False]
    vote.close()


def test_without_a_process_group_it_answers_this_ranks_own_view():
    from ftrt import RoundEndVote

    rt = _Asked(0, 0, asked_from=1)
    vote = RoundEndVote(rt)
    got = []
    for step in range(3):
        rt.step = step
        got.append(vote())
    assert got == [False, True, True]
