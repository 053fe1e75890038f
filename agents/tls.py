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
from dataclasses import dataclass
from pathlib import Path

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


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="this agent's certificate (PEM), for mutual "
                   "TLS between agents; it must name --host")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="the CA that signed every agent's certificate")


def from_args(ns: argparse.Namespace) -> AgentTls:
    return AgentTls(ns.tls_cert or "", ns.tls_key or "", ns.tls_ca or "").check().absolute()
