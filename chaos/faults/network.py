"""Network faults: partition a node (its link goes down) from etcd and every other node, then heal.

Needs the scenario's ``cluster.netns``: each node runs in its own network namespace
(:class:`ftrt.chaos.netns.NetLab`), so cutting one link isolates exactly that node while its
processes run on, unaware, as on a real machine behind a failed switch port.
"""

from __future__ import annotations

from ftrt.chaos.faults import Context, Injected


def partition_node(ctx: Context, fault) -> Injected:
    if ctx.lab is None:
        raise RuntimeError("partition_node needs the nodes in network namespaces (cluster.netns: true)")
    node = ctx.pick_node(fault.target)
    i = ctx.node_index(node)
    ctx.lab.partition(i)
    return Injected(node, end=lambda: ctx.lab.heal(i),
                    detail=f"link of {ctx.lab.node_ip(i)} down for {fault.duration_s} s (etcd and peers unreachable)")
