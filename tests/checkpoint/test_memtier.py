"""Pure logic of the memory tier: which checkpoint to use, who needs what, resharding copies.

Arenas here are real files written through :class:`ftrt.checkpoint.memtier.Arena` (what workers
do), laid out by hand as two old ranks would have saved them.
"""

from __future__ import annotations

import pytest
import torch

from ftrt.checkpoint import memtier
from ftrt.checkpoint.memindex import IndexEntry
from ftrt.checkpoint.memtier import Arena, Unsupported


def save_rank(mem_dir, rank: int, world: int, chunks: dict[str, tuple[torch.Tensor, list[int], list[int]]],
              step: int = 5) -> None:
    """Write one old rank's arena: ``chunks[key] = (local tensor, global shape, global offset)``."""
    entries, pos = [], 0
    for key, (t, gshape, goff) in chunks.items():
        nbytes = t.numel() * t.element_size()
        entries.append(IndexEntry(key=key, dtype=str(t.dtype), offset=pos, nbytes=nbytes, local_shape=list(t.shape),
                                  global_shape=gshape, global_offset=goff))
        pos += (nbytes + memtier.ALIGN - 1) // memtier.ALIGN * memtier.ALIGN
    arena = Arena(str(mem_dir), rank)
    bufs = arena.buffers(0, entries, pos)
    for key, (t, _, _) in chunks.items():
        bufs[key].copy_(t)
    arena.commit(slot=0, step=step, round_no=1, world=world, entries=entries, size=pos, skeleton={"dict": []})


def load(mem_dir, with_files: bool = True):
    found = {m["rank"]: m for m in memtier.scan(str(mem_dir))}
    arenas = {r: torch.from_file(m["file"], shared=False, size=m["size"], dtype=torch.uint8) for r, m in found.items()}
    files = {r: m["file"] for r, m in found.items()} if with_files else None
    return found, arenas, files


WHOLE = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def row_shards(mem_dir):
    save_rank(mem_dir, 0, 2, {"w": (WHOLE[:3].clone(), [6, 4], [0, 0])})
    save_rank(mem_dir, 1, 2, {"w": (WHOLE[3:].clone(), [6, 4], [3, 0])})


@pytest.mark.parametrize("with_files", [True, False], ids=["pread", "mapping"])
def test_row_shards_of_two_ranks_fill_one_whole_tensor(tmp_path, with_files):
    row_shards(tmp_path)
    old, arenas, files = load(tmp_path, with_files)
    target = torch.full((6, 4), -1.0)
    memtier.fill({"w": target}, old, arenas, files)
    assert torch.equal(target, WHOLE)


def test_a_non_contiguous_target_is_copied_not_read(tmp_path):
    row_shards(tmp_path)
    old, arenas, files = load(tmp_path)
    target = torch.full((4, 6), -1.0).t()  # shape (6, 4), not contiguous
    memtier.fill({"w": target}, old, arenas, files)
    assert torch.equal(target, WHOLE)


def test_large_tensors_are_cut_into_pieces_that_land_at_the_right_offsets(tmp_path, monkeypatch):
    monkeypatch.setattr(memtier, "COPY_PIECE", 256)
    big = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    save_rank(tmp_path, 0, 2, {"a": (torch.ones(3), [3], [0]), "w": (big[:32].clone(), [64, 16], [0, 0])})
    save_rank(tmp_path, 1, 2, {"a": (torch.ones(3), [3], [0]), "w": (big[32:].clone(), [64, 16], [32, 0])})
    old, arenas, files = load(tmp_path)
    target = {"a": torch.zeros(3), "w": torch.zeros(64, 16)}
    memtier.fill(target, old, arenas, files)
    assert torch.equal(target["w"], big) and torch.equal(target["a"], torch.ones(3))


def test_a_replicated_tensor_needs_only_one_old_copy(tmp_path):
    save_rank(tmp_path, 0, 2, {"w": (WHOLE.clone(), [6, 4], [0, 0])})
    save_rank(tmp_path, 1, 2, {"w": (WHOLE.clone(), [6, 4], [0, 0])})
    old, arenas, files = load(tmp_path)
    del arenas[0]  # only old rank 1's arena is here
    target = torch.zeros(6, 4)
    memtier.fill({"w": target}, old, arenas, files)
    assert torch.equal(target, WHOLE)
    assert memtier.needed_ranks({"w": target}, old, local={1}) == set()


def test_needed_ranks_names_the_shards_held_elsewhere(tmp_path):
    row_shards(tmp_path)
    old, _, _ = load(tmp_path)
    target = {"w": torch.zeros(6, 4)}
    assert memtier.needed_ranks(target, old, local={0}) == {1}
    assert memtier.needed_ranks(target, old, local={0, 1}) == set()


def test_a_changed_shape_or_dtype_is_unsupported_not_silently_wrong(tmp_path):
    row_shards(tmp_path)
    old, arenas, files = load(tmp_path)
    with pytest.raises(Unsupported, match="w: saved as torch.float32"):
        memtier.fill({"w": torch.zeros(7, 4)}, old, arenas, files)
    with pytest.raises(Unsupported, match="w: saved as torch.float32"):
        memtier.fill({"w": torch.zeros(6, 4, dtype=torch.float64)}, old, arenas, files)
    with pytest.raises(Unsupported, match="not in the memory checkpoint"):
        memtier.fill({"v": torch.zeros(6, 4)}, old, arenas, files)


def index(step: int, rank: int, world: int, rnd: int = 1) -> dict:
    return {"step": step, "round": rnd, "rank": rank, "world": world}


def test_choose_takes_the_newest_checkpoint_every_old_rank_of_which_is_held():
    per_new_rank = [
        [index(7, 0, 2), index(6, 0, 2), index(6, 1, 2)],  # new rank 0 holds step 7 of rank 0 only
        [index(5, 0, 2), index(5, 1, 2)],
    ]
    assert memtier.choose(per_new_rank) == (6, 1, 2, {0: 0, 1: 0})
    per_new_rank[1].append(index(7, 1, 2))
    assert memtier.choose(per_new_rank) == (7, 1, 2, {0: 0, 1: 1})
    assert memtier.choose([[index(7, 0, 3)], [index(7, 1, 3)]]) is None  # old rank 2 is lost
    assert memtier.choose([[], []]) is None


def whole_or_shard(step: int, rank: int, world: int, sharded: bool) -> dict:
    """An index whose one tensor (8 x 4) is whole on every rank, or split by rows among them."""
    rows = 8 // world if sharded else 8
    entry = {"key": "w", "local_shape": [rows, 4], "global_shape": [8, 4],
             "global_offset": [rank * rows if sharded else 0, 0]}
    return {**index(step, rank, world), "entries": [entry]}


def test_choose_takes_a_newer_replicated_checkpoint_that_the_survivors_cover_alone():
    # Data parallel: old rank 1's node is gone and its replica (step 6) lags; old rank 0's own copy
    # of step 8 holds every tensor whole, so step 8 is whole.
    survivors = [[whole_or_shard(8, 0, 2, False), whole_or_shard(7, 0, 2, False), whole_or_shard(6, 1, 2, False)]]
    assert memtier.choose(survivors) == (8, 1, 2, {0: 0})
    # Sharded: rank 0's rows alone are half the tensor; the newest step held in full is 6.
    sharded = [[whole_or_shard(8, 0, 2, True), whole_or_shard(6, 0, 2, True), whole_or_shard(6, 1, 2, True)]]
    assert memtier.choose(sharded) == (6, 1, 2, {0: 0, 1: 0})
    assert memtier.choose([[whole_or_shard(8, 0, 2, True)]]) is None


def test_an_arena_rotates_its_slots_and_a_new_worker_of_the_rank_takes_over_its_indexes(tmp_path):
    import json

    entries, size = memtier.layout({"w": torch.zeros(4)})

    def save(arena: Arena, step: int) -> int:
        slot = 1 - arena.current_slot() if arena.current_slot() is not None else 0
        arena.buffers(slot, entries, size)["w"].fill_(step)
        arena.commit(slot=slot, step=step, round_no=1, world=1, entries=entries, size=size, skeleton={"dict": []})
        return slot

    def on_disk(name: str):
        path = tmp_path / "own" / "rank-0" / name
        return json.loads(path.read_text())["step"] if path.exists() else None

    first = Arena(str(tmp_path), 0)
    assert first.current_slot() is None
    assert [save(first, s) for s in (1, 2, 3)] == [0, 1, 0]
    assert (on_disk("current.json"), on_disk("previous.json")) == (3, 2)
    # The rank's next worker (after a restart) finds the same current slot, so it never writes over
    # the newest checkpoint; rewriting the other slot withdraws the checkpoint that slot held first.
    second = Arena(str(tmp_path), 0)
    assert second.current_slot() == 0
    second.buffers(1, entries, size)
    assert (on_disk("current.json"), on_disk("previous.json")) == (3, None)
    assert {m["step"] for m in memtier.scan(str(tmp_path))} == {3}
    assert save(second, 4) == 1 and (on_disk("current.json"), on_disk("previous.json")) == (4, 3)
