"""Checkpointer.retire on two real gloo ranks: when a worker changes rounds in place, a save still in
flight on the old group is given up at once (a frozen peer holds it), never committed; a save that
fails (a dead peer) is not retried; a checkpointer built on the new group commits again."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.ranks import run_ranks, say

torch = pytest.importorskip("torch")


def _committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[-1]) for p in root.glob("*/manifest.json"))


def _rank(rank: int, init: str, root: str, peer: str, out) -> None:
    import torch.distributed as dist

    from ftrt.checkpoint import Checkpointer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    state = {"w": torch.arange(1000, dtype=torch.float32) + rank}
    ck = Checkpointer(root, retry_backoff=5.0)
    ck.save(1, state).wait()
    if rank == 1:
        say(out, rank, "saved step 1")
        if peer == "frozen":
            time.sleep(3600)  # never takes part in the save of step 2: its sockets stay open
        os._exit(0)  # a dead peer: its sockets close
    time.sleep(0.5)  # the peer is gone or frozen
    handle = ck.save(2, state)
    handle.wait_staged()
    time.sleep(0.3)  # the persist thread is in DCP's collectives with the peer
    t0 = time.monotonic()
    ck.retire()
    retired_s = time.monotonic() - t0
    try:
        ck.save(3, state)
        refused = ""
    except Exception as exc:  # noqa: BLE001 - what it raises is checked below
        refused = str(exc)
    if peer == "dead":
        handle._future.exception(timeout=30)  # the save fails on its own, without a 5 s retry backoff
    failed_s = time.monotonic() - t0
    say(out, rank, {"retired_s": retired_s, "failed_s": failed_s, "refused": refused})
    os._exit(0)  # the old group is never freed (a thread may still wait on the frozen peer)


@pytest.mark.parametrize("peer", ["frozen", "dead"])
def test_a_retired_checkpointer_gives_up_its_save_at_once_and_never_commits_it(tmp_path, peer):
    root = tmp_path / "ck"
    said = run_ranks(_rank, tmp_path, str(root), peer, kill=(1,))
    got = said[0]
    assert said[1] == "saved step 1"
    assert got["retired_s"] < 3.0, got  # staging only; not the save stuck on the peer
    assert "closed" in got["refused"], got
    if peer == "dead":
        assert got["failed_s"] < 4.0, got  # no retry after a 5 s backoff
    time.sleep(0.5)
    assert _committed(root) == [1], "a retired checkpointer committed a save"
