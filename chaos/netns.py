"""Network namespaces for chaos runs: every node behind its own link, so a partition is one command.

Layout (needs root and iproute2's ``ip``; iptables and nft are not needed, and not installed
here): a bridge ``ftbr<k>`` in the root namespace holds ``10.213.<k>.1/24`` (etcd listens there);
node ``i`` lives in the namespace ``ftrt<k>n<i>`` whose only link, ``eth0`` (one end of a veth
pair, the other end on the bridge), holds ``10.213.<k>.<10+i>/24``, with loopback up for its own
workers. :meth:`NetLab.partition` sets the node's bridge-side link down: nothing reaches the node
and it reaches nothing, etcd included, while its processes run on; :meth:`NetLab.heal` sets it up
again. ``k`` is drawn so that concurrent runs do not collide; :meth:`NetLab.close` removes
everything it made.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

SUBNET = "10.213"
"""The /16 the labs draw their /24 from (private, never routed off this machine)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip() or res.returncode}")
    return res


def unavailable() -> str | None:
    """Why this machine cannot give nodes their own network namespace, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or skip the scenarios with cluster.netns)"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    name = f"ftrtprobe{os.getpid() % 100000}"
    res = _ip("netns", "add", name, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class NetLab:
    """A bridge and one namespace per node; use :meth:`open`, then :meth:`close` (or ``with``)."""

    def __init__(self, nodes: int, rng: random.Random | None = None) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"a NetLab holds 1..200 nodes, not {nodes}")
        self.nodes = nodes
        used = _ip("-4", "-o", "addr", "show", check=False).stdout
        free = [k for k in range(1, 255) if f" {SUBNET}.{k}." not in used]
        if not free:
            raise RuntimeError(f"every {SUBNET}.k.0/24 subnet is in use on this machine")
        self.k = (rng or random.Random()).choice(free)
        self.bridge = f"ftbr{self.k}"
        self.host_ip = f"{SUBNET}.{self.k}.1"
        self._made: list[tuple[str, str]] = []  # ("link" | "netns", name), for close()

    def netns(self, i: int) -> str:
        return f"ftrt{self.k}n{i}"

    def node_ip(self, i: int) -> str:
        return f"{SUBNET}.{self.k}.{10 + i}"

    def _veth(self, i: int) -> str:
        return f"ftv{self.k}n{i}"

    def open(self) -> "NetLab":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.nodes):
                ns, veth = self.netns(i), self._veth(i)
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                self._made.append(("link", veth))
                _ip("link", "set", f"{veth}p", "netns", ns)
                _ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
        except Exception:
            self.close()
            raise
        return self

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.netns(i), *argv]

    @staticmethod
    def env() -> dict[str, str]:
        """What a process in a node's namespace needs: gloo on the node's one link."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}

    def partition(self, i: int) -> None:
        """Cut node ``i`` off from etcd and every other node (its link goes down)."""
        _ip("link", "set", self._veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._veth(i), "up")

    def close(self) -> None:
        """Remove every namespace and link this lab made (a namespace's veth end goes with it)."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made = []

    def __enter__(self) -> "NetLab":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
