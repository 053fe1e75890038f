"""Mutual TLS between agents (``ftrt launch --tls-cert F --tls-key F --tls-ca F``).

With it, an agent's gRPC server accepts only callers whose certificate the job's CA signed, and
every agent-to-agent channel (replication, liveness streams) and ``ftrt status``'s questions to
agents present this node's certificate and check the other side's against the same CA: agent
traffic, the job token included, is encrypted, and a caller without a certificate of the job's
CA cannot even complete a handshake. A peer's certificate must name the address it is dialled at
(``--host``) in its subject alternative names. Without the flags agents speak plaintext and the
job token (:mod:`.auth`) is what guards state-changing calls. Workers talk to their agent over
pipes, not the network, so they need nothing.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc
import grpc.aio

from ftrt.tlsfiles import check_ca, check_pair, read_file


@dataclass(frozen=True)
class AgentTls:
    """This node's certificate and key and the job's CA; all empty: plaintext."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def check(self) -> "AgentTls":
        """Raise :class:`~ftrt.errors.ConfigError` unless all three files are given and fit; return self."""
        from ftrt.errors import ConfigError

        if not self.enabled:
            return self
        if not self.ca:
            raise ConfigError("--tls-cert/--tls-key need --tls-ca: the CA that signed every agent's certificate, "
                              "against which this agent checks its peers.")
        check_ca("--tls-ca", self.ca, "the agents' certificates")
        if not self.cert:
            raise ConfigError("--tls-ca needs --tls-cert and --tls-key: this agent's own certificate and key.")
        check_pair("--tls-cert", self.cert, "--tls-key", self.key)
        return self

    def absolute(self) -> "AgentTls":
        return AgentTls(*(str(Path(p).absolute()) if p else "" for p in (self.cert, self.key, self.ca)))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(read_file("--tls-key", self.key), read_file("--tls-cert", self.cert))],
            root_certificates=read_file("--tls-ca", self.ca), require_client_auth=True)

    def channel(self, addr: str) -> grpc.aio.Channel:
        """A channel to the agent at ``addr``: mutual TLS when enabled, else plaintext."""
        if not self.enabled:
            return grpc.aio.insecure_channel(addr)
        creds = grpc.ssl_channel_credentials(root_certificates=read_file("--tls-ca", self.ca),
                                             private_key=read_file("--tls-key", self.key),
                                             certificate_chain=read_file("--tls-cert", self.cert))
        return grpc.aio.secure_channel(addr, creds)

    def flags(self) -> list[str]:
        return [x for flag, v in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca))
                if v for x in (flag, v)]


PLAINTEXT = AgentTls()


class PeerChannels:
    """One channel per peer agent address, shared by the liveness streams and the replication links
    and kept across rounds. With mutual TLS every new channel costs a handshake on both sides, and
    a round change after a fault is exactly when an agent's neighbours change: kept channels (a
    successor monitored before it becomes the replication target) and pre-dialled ones (the next
    node after the neighbours, :meth:`dial`) take the handshakes off the recovery's path.
    gRPC channels reconnect on their own, so a kept channel outlives a peer's restart."""

    def __init__(self, tls: AgentTls) -> None:
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def get(self, addr: str) -> grpc.aio.Channel:
        """The channel to ``addr`` (:meth:`AgentTls.channel`: mutual TLS when the job has it; made
        on first use, not connected until used or dialled)."""
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = self.tls.channel(addr)
        return channel

    def dial(self, addr: str) -> None:
        """Connect to ``addr`` now (the handshake happens in the background), before it is needed."""
        self.get(addr).get_state(try_to_connect=True)

    def keep(self, addrs: Iterable[str]) -> None:
        """Close the channels to every address not in ``addrs`` (nobody uses them any more)."""
        wanted = set(addrs)
        for addr in [a for a in self._channels if a not in wanted]:
            task = asyncio.get_running_loop().create_task(self._channels.pop(addr).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @property
    def addresses(self) -> list[str]:
        return list(self._channels)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), *self._closing, return_exceptions=True)


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="this agent's certificate (PEM), for mutual "
                   "TLS between agents; it must name --host")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="the CA that signed every agent's certificate")


def from_args(ns: argparse.Namespace) -> AgentTls:
    return AgentTls(ns.tls_cert or "", ns.tls_key or "", ns.tls_ca or "").check().absolute()
