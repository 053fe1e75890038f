"""``ftrt.data.ElasticSampler``: the trained frontier survives restarts and world-size changes."""

from __future__ import annotations

import pytest
import torch

from ftrt.data import ElasticSampler
from ftrt.errors import ConfigError


def _global(samplers, batches):
    """The global batches the ranks of ``samplers`` train, advancing all of them, ``batches`` times."""
    out = []
    for _ in range(batches):
        shares = [next(iter(s)) for s in samplers]  # from the trained frontier, as after a restart
        out.append([i for share in shares for i in share])
        for s in samplers:
            s.advance()
    return out


def test_ranks_split_each_global_batch_and_together_cover_an_epoch_once():
    ss = [ElasticSampler(50, 8, rank=r, world=3, seed=1) for r in range(3)]
    got = _global(ss, len(ss[0]))
    assert [len(b) for b in got] == [8] * 6  # drop_last: 48 of 50
    flat = [i for b in got for i in b]
    assert len(set(flat)) == 48 and flat == ss[0].order(0)[:48]
    assert ss[0].epoch == 1 and ss[0].frontier == 0


def test_a_restart_at_another_world_size_trains_the_next_samples_exactly():
    reference = _global([ElasticSampler(100, 10, rank=r, world=2, seed=7) for r in range(2)], 25)
    first = [ElasticSampler(100, 10, rank=r, world=2, seed=7) for r in range(2)]
    before = _global(first, 7)
    saved = first[0].state_dict()
    assert saved["frontier"] == 70
    for world in (1, 3, 4):  # a node lost, or new ones: the same global sequence goes on
        again = [ElasticSampler(100, 10, rank=r, world=world, seed=7) for r in range(world)]
        for s in again:
            s.load_state_dict(saved)
        assert before + _global(again, 18) == reference


def test_the_order_is_a_pure_function_of_seed_and_epoch():
    a, b = ElasticSampler(30, 5, seed=3), ElasticSampler(30, 5, seed=3)
    assert a.order(2) == b.order(2) != a.order(3)
    assert ElasticSampler(30, 5, seed=3, shuffle=False).order(1) == list(range(30))
    assert a.ledger(0, 5) == a.order(0)[5:10]


def test_a_state_of_other_settings_or_position_is_refused():
    s = ElasticSampler(30, 5, seed=3)
    with pytest.raises(ConfigError, match="seed"):
        s.load_state_dict({**s.state_dict(), "seed": 4})
    with pytest.raises(ConfigError, match="frontier"):
        s.load_state_dict({**s.state_dict(), "frontier": 99})
    with pytest.raises(ConfigError, match="rank"):
        ElasticSampler(30, 5, rank=2, world=2)
    with pytest.raises(ConfigError, match="smaller than the world"):
        ElasticSampler(30, 2, rank=0, world=3)


def test_it_drives_a_dataloader():
    data = torch.arange(40).float()
    s = ElasticSampler(40, 8, rank=1, world=2, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=s)
    got = [b.tolist() for b in loader]
    assert len(got) == 5 and all(len(b) == 4 for b in got)
    assert [int(x) for b in got for x in b] == [i for start in range(0, 40, 8) for i in s.order(0)[start + 4:start + 8]]
