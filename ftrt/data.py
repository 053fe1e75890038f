"""``ElasticSampler``: data order whose saved state is the global trained frontier.

A ``DataLoader(dataset, batch_sampler=ElasticSampler(...))`` on every rank: each step trains one
*global batch* of ``global_batch`` samples, split over the ranks in contiguous shares (the first
``global_batch % world`` ranks take one more), exactly as the built-in GRPO trainer splits its
prompts. The order of an epoch is a permutation drawn from ``(seed, epoch)`` (or the identity
without ``shuffle``), the same on every rank and at every world size.

What a checkpoint keeps is :meth:`ElasticSampler.state_dict`: the epoch and how many samples of it
the job has *trained* (advanced past with :meth:`ElasticSampler.advance`, once per optimizer step),
not how far a loader has read ahead. A job restored at another world size builds its sampler with
the new ``rank`` and ``world``, loads that state and trains the very next global batch: no sample
skipped or repeated, whatever the world size. :meth:`ElasticSampler.ledger` says which sample ids
a global batch holds, for checking exactly that.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ftrt.errors import ConfigError


def _share(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ElasticSampler(torch.utils.data.Sampler[list[int]]):
    """A batch sampler over ``size`` samples for ``rank`` of ``world`` (see the module docstring)."""

    def __init__(self, size: int, global_batch: int, *, rank: int = 0, world: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        for name, value, least in (("size", size, 1), ("global_batch", global_batch, 1), ("world", world, 1)):
            if not isinstance(value, int) or value < least:
                raise ConfigError(f"ElasticSampler {name} = {value!r}: give a whole number >= {least}.")
        if not 0 <= rank < world:
            raise ConfigError(f"ElasticSampler rank = {rank!r} is not in 0..{world - 1} (world = {world}).")
        if global_batch < world:
            raise ConfigError(f"ElasticSampler global_batch = {global_batch} is smaller than the world ({world}): "
                              "some ranks would get no sample.")
        if drop_last and global_batch > size:
            raise ConfigError(f"ElasticSampler global_batch = {global_batch} exceeds the {size} samples with "
                              "drop_last: an epoch would have no batch.")
        self.size, self.global_batch, self.rank, self.world = size, global_batch, rank, world
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.frontier = 0
        """Samples of this epoch the job has trained (a multiple of ``global_batch`` but at an epoch's end)."""

    # -- the order ---------------------------------------------------------------------------------
    @property
    def epoch_samples(self) -> int:
        """Samples an epoch trains (with ``drop_last``, whole global batches only)."""
        return self.size - self.size % self.global_batch if self.drop_last else self.size

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s sample order (the same everywhere)."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + epoch) & ((1 << 63) - 1))
        return torch.randperm(self.size, generator=g).tolist()

    def ledger(self, epoch: int, start: int) -> list[int]:
        """The sample ids of the global batch of ``epoch`` that begins at sample ``start``."""
        order = self.order(epoch)
        return order[start:min(start + self.global_batch, self.epoch_samples)]

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's share of every global batch from the trained frontier to the epoch's end."""
        order = self.order(self.epoch)
        for start in range(self.frontier, self.epoch_samples, self.global_batch):
            batch = order[start:min(start + self.global_batch, self.epoch_samples)]
            lo, hi = _share(len(batch), self.world, self.rank)
            yield batch[lo:hi]

    def __len__(self) -> int:
        left = self.epoch_samples - self.frontier
        return -(-left // self.global_batch)

    # -- the trained frontier ------------------------------------------------------------------------
    def advance(self, batches: int = 1) -> None:
        """``batches`` global batches were trained (call once per optimizer step); an epoch that is
        done rolls over to the next."""
        for _ in range(batches):
            self.frontier = min(self.frontier + self.global_batch, self.epoch_samples)
            if self.frontier >= self.epoch_samples:
                self.epoch, self.frontier = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "frontier": self.frontier, "seed": self.seed, "size": self.size,
                "global_batch": self.global_batch, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved frontier (at any world size). The order's settings must match."""
        for key in ("seed", "size", "global_batch", "shuffle", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(f"The saved sampler state has {key} = {state.get(key)!r}, this sampler "
                                  f"{getattr(self, key)!r}: resume with the settings the state was saved with.")
        epoch, frontier = state.get("epoch"), state.get("frontier")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(frontier, int) \
                or not 0 <= frontier <= self.epoch_samples:
            raise ConfigError(f"The saved sampler state (epoch {epoch!r}, frontier {frontier!r}) is not a "
                              f"position in epochs of {self.epoch_samples} samples.")
        self.epoch, self.frontier = epoch, frontier
