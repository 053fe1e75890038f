"""Membership faults: a new node joins the running job."""

from __future__ import annotations

from ftrt.chaos.faults import Context, Injected


def add_node(ctx: Context, fault) -> Injected:
    if fault.target != "random" and fault.target not in ctx.nodes:
        name = fault.target
    else:
        i = 0
        while f"node{i}" in ctx.nodes:
            i += 1
        name = f"node{i}"
    ctx.nodes[name] = ctx.start_node(name)
    return Injected(name, detail="a new agent starts and joins")
