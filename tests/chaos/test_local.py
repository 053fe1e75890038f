"""Local nodes: whether an agent's spares are warm is its own answer to ``Status``, not its log."""

from __future__ import annotations

import pytest

from ftrt.chaos.local import LocalNode, find_agents, spares_warm, wait_until
from tests.agents.harness import FAST_WARM, ddp_args


@pytest.mark.slow
@pytest.mark.parametrize("agent_tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_spares_warm_asks_the_agent_where_it_registered(tmp_path, etcd_endpoint, job_id, agent_tls):
    tls = []
    if agent_tls:
        from ftrt.agents.peers.tls import AgentTls
        from ftrt.store.certs import tls_dir

        files = tls_dir(tmp_path / "tls")
        tls = AgentTls(str(files.server_cert), str(files.server_key), str(files.ca)).flags()
    args = ["--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1", "--nproc-per-node", "2", *tls, *FAST_WARM,
            *ddp_args(tmp_path / "p.jsonl", steps=100000, step_time=0.05)]
    node = LocalNode(tmp_path, "n0", args)
    assert node.agent.addr is None and not node.spares_warm(timeout=0.5)  # not even started: not warm
    node.start()
    try:
        wait_until(lambda: find_agents([node]) or node.agent.addr, 30, "the agent to register")
        # Warm once the round runs and the agent has two spares again (the first two went to the
        # round; the early spares are warm before the round takes them, so wait for its ranks too).
        def running() -> bool:
            st = node.agent_status()
            return st is not None and len([w for w in st.workers if w.rank >= 0]) == 2

        wait_until(running, 60, "the round's two ranks")
        wait_until(node.spares_warm, 60, "two warm spares")
        st = node.agent_status()
        assert st.warm_workers >= 2 and st.health.node_id == "n0" and len(
            [w for w in st.workers if w.rank >= 0]) == 2
        assert spares_warm([node, node])
        node.freeze(agent_only=True)  # an agent that does not answer is not warm
        try:
            assert not node.spares_warm(timeout=0.5)
        finally:
            node.thaw()
        assert node.spares_warm()
    finally:
        node.cleanup()
    assert not node.spares_warm(timeout=0.5)


def test_no_nodes_are_all_warm_and_a_standalone_agent_cannot_be_asked(tmp_path):
    from ftrt.errors import ConfigError

    assert spares_warm([])
    node = LocalNode(tmp_path, "n0", ["--standalone", "-m", "ftrt.grpo"])
    with pytest.raises(ConfigError, match="standalone"):
        node.spares_warm()


def test_an_agent_a_fault_keeps_from_answering_is_judged_by_what_it_last_logged(tmp_path):
    from ftrt.chaos.runner import ChaosRun

    class Link:
        def __init__(self, warm: bool) -> None:
            self.warm, self.asked = warm, False

        async def spares_warm(self, timeout: float) -> bool:
            self.asked = True
            return self.warm

    class Node:
        def __init__(self, warm: bool, logged: bool) -> None:
            self.agent, self.logged, self.up = Link(warm), logged, True

        def alive(self) -> bool:
            return self.up

        def spares_warm_in_log(self) -> bool:
            return self.logged

    nodes = {"a": Node(True, False), "b": Node(False, True)}
    assert ChaosRun._spares_warm(nodes, {"b"}) and not nodes["b"].agent.asked  # frozen b: not asked
    assert not ChaosRun._spares_warm(nodes, set())
    assert not ChaosRun._spares_warm(nodes, {"a", "b"})
    nodes["b"].up = False
    assert ChaosRun._spares_warm(nodes, set())  # a dead node is not a live agent

    node = LocalNode(tmp_path, "n0", [])
    node.log_path.write_text("warm workers ready after 2.0 s\nround 1: started ranks 0-0 of 2\n")
    assert not node.spares_warm_in_log()
    with open(node.log_path, "a") as f:
        f.write("spares warm again after 0.1 s\n")
    assert node.spares_warm_in_log()
