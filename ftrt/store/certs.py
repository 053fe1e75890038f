"""A throwaway certificate authority for TLS on one machine: ``ftrt etcd --tls DIR`` and tests.

:func:`tls_dir` makes (or reuses) in ``DIR`` a CA, a server certificate for the loopback names
and a client certificate per name, with the ``cryptography`` package. They are for trying ftrt's
TLS and auth out and for tests; a production cluster has its own PKI (cert-manager, Vault, the
cloud's), whose files go to the same ``--etcd-cacert/--etcd-cert/--etcd-key`` flags.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ftrt.errors import ConfigError
from ftrt.privatefiles import private_dir, write_private

SERVER_NAMES = ("localhost", "127.0.0.1", "::1")
"""The names the server certificate carries: etcd on loopback, reached by name or address."""


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one :func:`tls_dir`."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server-key.pem"

    def client_cert(self, name: str = "ftrt") -> Path:
        return self.directory / f"client-{name}.pem"

    def client_key(self, name: str = "ftrt") -> Path:
        return self.directory / f"client-{name}-key.pem"


def tls_dir(directory: str | os.PathLike, clients: Sequence[str] = ("ftrt", "root"), *,
            days: int = 365, hosts: Sequence[str] = ()) -> TlsFiles:
    """Make a CA, a server certificate for the loopback names and ``hosts`` and a client
    certificate for each of ``clients`` (its common name, which etcd takes as the user name under
    client-certificate auth) in ``directory``, keeping whatever is there already. The folder is
    private (0700) and so are the keys (0600)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise ConfigError("Making TLS certificates needs the 'cryptography' package: pip install cryptography.") from exc
    files = TlsFiles(Path(directory))
    private_dir(files.directory)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ftrt"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(path: Path, key) -> None:
        raw = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        write_private(path, raw)

    def issue(subject: x509.Name, key, issuer: x509.Name, signer, *, ca: bool = False, sans=(), usage=()):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                              content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False,
                                              encipher_only=False, decipher_only=False), critical=True)
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
        return b.sign(signer, hashes.SHA256())

    if files.ca.exists() and (files.directory / "ca-key.pem").exists():
        ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
        ca_key = serialization.load_pem_private_key((files.directory / "ca-key.pem").read_bytes(), None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = issue(name("ftrt test CA"), ca_key, name("ftrt test CA"), ca_key, ca=True)
        write_key(files.directory / "ca-key.pem", ca_key)
        files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(cert_path: Path, key_path: Path, cn: str, sans, usage) -> None:
        if cert_path.exists() and key_path.exists() and set(sans) <= names_in(cert_path):
            return  # kept, unless it lacks a name asked for now (another --cert-host)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = issue(name(cn), key, ca_cert.subject, ca_key, sans=sans, usage=usage)
        write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def names_in(cert_path: Path) -> set:
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            return set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        except (ValueError, x509.ExtensionNotFound):
            return set()

    def san(host: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    # etcd also uses its server certificate as a client (its gateway, its own health checks).
    leaf(files.server_cert, files.server_key, "etcd", [san(h) for h in dict.fromkeys([*SERVER_NAMES, *hosts])],
         [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    for client in clients:
        leaf(files.client_cert(client), files.client_key(client), client, [], [ExtendedKeyUsageOID.CLIENT_AUTH])
    return files
