"""Fixtures of the agent tests."""

from __future__ import annotations

import pytest

from tests.agents.harness import FAST_WARM, Node


@pytest.fixture
def make_node(tmp_path, etcd_endpoint, job_id):
    nodes: list[Node] = []

    def make(node_id: str, script: list[str], *, nnodes: str = "2:3", extra: tuple[str, ...] = (),
             start: bool = True) -> Node:
        args = [
            "--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", nnodes, "--lease-ttl", "2",
            "--first-round-wait", "1.0", *FAST_WARM, *extra, *script,
        ]
        node = Node(tmp_path, node_id, args)
        nodes.append(node)
        return node.start() if start else node

    yield make
    for n in nodes:
        n.cleanup()
