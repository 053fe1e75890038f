"""Peer replication over real gRPC between two memory directories: what is sent, and how often."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from ftrt.auth import JobToken
from ftrt.chaos.local import until
from ftrt.agents.peers.replicator import Replicator, make_mem_dir
from ftrt.checkpoint.memindex import IndexEntry
from ftrt.checkpoint.memtier import Arena
from ftrt.privatefiles import private_dir
from ftrt.store.memory import MemoryStore
from ftrt.agents.peers.claims import ClaimBook
from tests.agents.replicas import KEYS, registered, replica_server


TOKEN = JobToken("5" * 64)


def commit(mem_dir, rank: int, step: int, sharded: bool, round_no: int = 1) -> None:
    t = torch.full((4, 4), float(step))
    global_shape, offset = ([8, 4], [4 * rank, 0]) if sharded else ([4, 4], [0, 0])
    entries = [IndexEntry(key="w", dtype=str(t.dtype), offset=0, nbytes=t.numel() * 4, local_shape=[4, 4],
                          global_shape=global_shape, global_offset=offset)]
    arena = Arena(str(mem_dir), rank)
    slot = (arena.current_slot() or 0) ^ 1
    arena.buffers(slot, entries, 4096)["w"].copy_(t)
    arena.commit(slot=slot, step=step, round_no=round_no, world=2, entries=entries, size=4096, skeleton={"dict": []})


def replica_step(mem_dir, rank: int) -> int | None:
    path = mem_dir / "replicas" / "a" / f"rank-{rank}" / "current.json"
    return json.loads(path.read_text())["step"] if path.exists() else None


def test_sharded_ranks_go_after_every_checkpoint_and_whole_ones_at_most_every_interval(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"

    async def main():
        store = MemoryStore()
        server, port, _ = await replica_server(str(dst), store, TOKEN)
        claims = await registered(store, "a")
        rep = Replicator("a", str(src), TOKEN, claims, interval=0.5)
        rep.set_peers([f"127.0.0.1:{port}"])
        try:
            t0 = time.monotonic()
            for step in range(1, 11):  # 10 checkpoints in ~0.3 s
                commit(src, 0, step, sharded=False)
                commit(src, 1, step, sharded=True)
                rep.notify(0)
                rep.notify(1)
                await asyncio.sleep(0.03)
            await until(lambda: replica_step(dst, 1) == 10, 10, "the newest sharded replica")  # after every one
            lagging = replica_step(dst, 0)
            await until(lambda: replica_step(dst, 0) == 10, 10, "the newest whole replica")  # on its interval
            took = time.monotonic() - t0
            return lagging, dict(rep.sends), took
        finally:
            await rep.close()
            await server.stop(None)

    lagging, sends, took = asyncio.run(main())
    assert lagging is not None and lagging < 10, lagging
    assert sends[0] <= 2 + math.ceil(took / 0.5), (sends, took)  # the first, then at most one an interval
    assert sends[1] >= 5, sends  # latest-wins may merge a few, but most went


def test_a_drain_flushes_the_newest_sharded_checkpoint_to_its_peers_and_says_when_it_cannot(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"

    async def main():
        store = MemoryStore()
        server, port, _ = await replica_server(str(dst), store, TOKEN)
        claims = await registered(store, "a")
        lonely = Replicator("a", str(src), TOKEN, claims, interval=60)
        rep = Replicator("a", str(src), TOKEN, claims, interval=60)
        try:
            commit(src, 0, 3, sharded=False)
            assert await rep.flush(1.0) is True  # only whole ranks: the staying ranks hold the same step
            assert replica_step(dst, 0) is None
            commit(src, 1, 3, sharded=True)
            assert await lonely.flush(1.0) is False  # a sharded rank and nobody to give it to
            rep.set_peers([f"127.0.0.1:{port}"])
            for _ in range(100):
                if replica_step(dst, 1) == 3:
                    break
                await asyncio.sleep(0.02)
            commit(src, 1, 4, sharded=True)  # the step the round ended with; no notify reached the replicator
            assert await rep.flush(5.0) is True
            return replica_step(dst, 1)
        finally:
            await rep.close()
            await lonely.close()
            await server.stop(None)

    assert asyncio.run(main()) == 4


def test_checkpoints_of_ranks_the_workers_left_in_place_go_once_every_held_rank_saved_in_a_later_round(tmp_path):
    """Workers that changed ranks in place (2 -> 1 when a node before them left) leave their old
    rank's memory checkpoints behind; they are removed once every rank held has a newer one."""
    mem = tmp_path / "mem"
    commit(mem, 2, step=9, sharded=False, round_no=3)
    commit(mem, 3, step=9, sharded=False, round_no=3)
    rep = Replicator("a", str(mem), TOKEN, ClaimBook(MemoryStore(), KEYS, "a", "127.0.0.1", lambda: None), interval=60)
    assert rep.prune({1, 2}) == []  # rank 1 has no checkpoint yet: rank 3's may still be the newest
    commit(mem, 1, step=10, sharded=False, round_no=4)
    assert rep.prune({1, 2}) == []  # rank 2's is of round 3, as rank 3's: nothing is older than every held one
    commit(mem, 2, step=10, sharded=False, round_no=4)
    assert rep.prune({1, 2}) == [3]
    assert sorted(p.name for p in (mem / "own").iterdir()) == ["rank-1", "rank-2"]
    assert rep.prune({1, 2}) == []  # remembered


def test_memory_checkpoints_and_their_replicas_are_private_to_the_user_whatever_the_umask(tmp_path):
    """The memory tier holds the job's weights on the host's shared memory: with the most open
    umask, every folder the node's memory directory has is 0700 and every file 0600, on the node
    that saved (its arenas, their indexes) and on the peer that holds the replica; a slot file
    left 0644 by an older version is made private again when it is rewritten."""
    old_umask = os.umask(0)
    src, dst = Path(make_mem_dir()), Path(make_mem_dir())
    try:
        async def main():
            store = MemoryStore()
            server, port, _ = await replica_server(str(dst), store, TOKEN)
            claims = await registered(store, "a")
            rep = Replicator("a", str(src), TOKEN, claims, interval=0.01)
            rep.set_peers([f"127.0.0.1:{port}"])
            try:
                for step in (1, 2):  # two saves: both slots and both indexes exist
                    commit(src, 0, step, sharded=True)
                    rep.notify(0)
                    await until(lambda: replica_step(dst, 0) == step, 10, f"the replica of step {step}")
            finally:
                await rep.close()
                await server.stop(None)

        private_dir(src / "own" / "rank-0")
        (src / "own" / "rank-0" / "slot-1.bin").write_bytes(b"")  # an older version's file, 0666 here
        asyncio.run(main())
        for root in (src, dst):
            folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
            files = [p for p in root.rglob("*") if p.is_file()]
            assert len(files) >= 4, files  # two slots and two indexes
            assert {oct(p.stat().st_mode & 0o777) for p in folders} == {"0o700"}, folders
            assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}, \
                [(p, oct(p.stat().st_mode & 0o777)) for p in files]
        assert (dst / "replicas" / "a" / "rank-0" / "previous.json").exists()
    finally:
        os.umask(old_umask)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
