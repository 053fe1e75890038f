"""Where the credentials of an etcd that ftrt started on this host live, so that its clients on
the same host find them without flags: one private folder per endpoint in the user's state
directory (``$FTRT_STATE_DIR``, else ``$XDG_STATE_HOME/ftrt``, else ``~/.local/state/ftrt``).

``ftrt etcd`` is closed by default: it serves clients over TLS and requires a client certificate
signed by a CA it makes in that folder (etcd's ``--client-cert-auth``), so a process that cannot
read the folder (0700, keys 0600) cannot read or write anything in etcd, the job's token included.
``ftrt launch``, ``status``, ``drain``, ``rollout serve`` and ``ckpt`` given ``--etcd HOST:PORT`` and
no ``--etcd-*`` flags use the folder's files when it has them (:func:`find`); on other hosts, pass
copies of them with ``--etcd-cacert/--etcd-cert/--etcd-key`` (docs/security.md). An ``http://``
endpoint asks for plaintext and is never looked up.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Mapping, Sequence

from ftrt import envnames
from ftrt.store.access import EtcdAccess
from ftrt.store.certs import SERVER_NAMES, TlsFiles, tls_dir

LOCAL_NAMES = frozenset({*SERVER_NAMES, "0.0.0.0", "::"})
"""Hosts whose etcd this host reaches on loopback (its server certificate names those)."""

CLIENT = "ftrt"
"""The common name of the client certificate made for the job's processes."""


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """This user's ftrt state directory (see the module)."""
    e = os.environ if environ is None else environ
    if e.get(envnames.STATE_DIR):
        return Path(e[envnames.STATE_DIR])
    base = e.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "ftrt"


def folder(host: str, port: int, environ: Mapping[str, str] | None = None) -> Path:
    """The credentials folder of the etcd at ``host:port``. Every loopback name shares one, with
    the wildcard addresses: an etcd listening on all of them is reached on loopback here."""
    name = "loopback" if host.strip("[]") in LOCAL_NAMES else re.sub(r"[^A-Za-z0-9.-]", "_", host)
    return state_dir(environ) / "etcd" / f"{name}-{int(port)}"


def make(host: str, port: int, environ: Mapping[str, str] | None = None, *,
         extra_hosts: Sequence[str] = ()) -> TlsFiles:
    """Make (or keep) the CA, server and client certificates of the etcd at ``host:port``, its
    certificate also naming ``extra_hosts`` (names clients on other hosts dial it by)."""
    return tls_dir(folder(host, port, environ), clients=(CLIENT,), hosts=(host, *extra_hosts))


def forget(host: str, port: int, environ: Mapping[str, str] | None = None) -> None:
    """Remove the credentials of the etcd at ``host:port`` (it now runs without them)."""
    shutil.rmtree(folder(host, port, environ), ignore_errors=True)


def _host_port(endpoint: str) -> tuple[str, int] | None:
    rest = endpoint.strip().split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def find(endpoints: str, environ: Mapping[str, str] | None = None) -> EtcdAccess | None:
    """The access to the etcd at ``endpoints`` (its first one) that ``ftrt etcd`` left on this host
    for this user, or None (none there, or an ``http://`` endpoint: plaintext asked for)."""
    first = endpoints.split(",")[0].strip()
    where = _host_port(first)
    if first.startswith("http://") or where is None:
        return None
    files = TlsFiles(folder(*where, environ))
    if not all(p.is_file() for p in (files.ca, files.client_cert(CLIENT), files.client_key(CLIENT))):
        return None
    return EtcdAccess(cacert=str(files.ca), cert=str(files.client_cert(CLIENT)), key=str(files.client_key(CLIENT)))


__all__ = ["CLIENT", "find", "folder", "forget", "make", "state_dir"]
