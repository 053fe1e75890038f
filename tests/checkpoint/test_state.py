"""The fast state dicts every save uses equal DCP's own and follow the live objects."""

from __future__ import annotations

import torch
from torch import nn

from ftrt.checkpoint import state as st


def _model_and_optim():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
    return a == b


def test_fast_state_dicts_equal_dcps_and_follow_changes_to_the_live_objects():
    model, opt = _model_and_optim()
    state = {"model": model, "optim": opt, "trainer": {"step": 3}}
    dicts = st.StateDicts()
    for _ in range(3):  # the first call checks the fast way against DCP's; later ones take it
        assert _same_tree(dicts.to_dcp(state), st.to_dcp(state))
    assert dicts._models[id(model)] is not None and dicts._optims[id(opt)] is not None
    # a scheduler changes lr; a parameter gets new storage; the structure is the same
    opt.param_groups[0]["lr"] = 5e-4
    model[0].weight.data = torch.zeros(8, 4)
    fast = dicts.to_dcp(state)
    assert fast["optim"]["param_groups"][0]["lr"] == 5e-4
    assert fast["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert _same_tree(fast, st.to_dcp(state))


def test_a_changed_structure_is_checked_against_dcp_again():
    model, opt = _model_and_optim()
    state = {"model": model, "optim": opt}
    dicts = st.StateDicts()
    dicts.to_dcp(state)
    model.register_buffer("extra", torch.ones(2))
    assert "extra" in dicts.to_dcp(state)["model"]
    assert _same_tree(dicts.to_dcp(state), st.to_dcp(state))
