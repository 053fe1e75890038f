"""How to reach a secured etcd: TLS files, user and password, checked before the first call.

One :class:`EtcdAccess` travels with the endpoints everywhere ftrt talks to etcd (agents,
``ftrt status``, the checkpoint pointer in workers, the chaos runner). It comes from the command
line (:func:`add_arguments`, :func:`from_args`; without flags, from the files an ``ftrt etcd`` on
this host left for the endpoint, :mod:`ftrt.store.localetcd`) or, in a worker, from the
environment the agent gave it (:meth:`EtcdAccess.env`, :func:`from_env`). A password is never on a command line: it
comes from ``FTRT_ETCD_PASSWORD`` or from a file (``--etcd-password-file``), and a worker gets
the file's path or inherits the variable, never the password in argv.

:meth:`EtcdAccess.check` reads every file once and reports the first problem as one
:class:`~ftrt.errors.ConfigError` naming the flag and the file, so a wrong path or a key that
does not match its certificate is a clear line at start-up, not a handshake failure later.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ftrt import envnames
from ftrt.errors import ConfigError
from ftrt.tlsfiles import check_ca, check_pair, read_file

ENV_CACERT = envnames.ETCD_CACERT
ENV_CERT = envnames.ETCD_CERT
ENV_KEY = envnames.ETCD_KEY
ENV_USER = envnames.ETCD_USER
ENV_PASSWORD = envnames.ETCD_PASSWORD
ENV_PASSWORD_FILE = envnames.ETCD_PASSWORD_FILE
ENV_TLS = envnames.ETCD_TLS
"""The environment names of the access settings (a worker's, and an operator's alternative to the
flags). ``FTRT_ETCD_TLS=1`` asks for TLS with the system's CA roots when no CA file is given."""


@dataclass(frozen=True)
class EtcdAccess:
    """Credentials for etcd. The default, all empty, is plaintext without auth.

    Args:
        cacert: PEM file of the CA(s) that signed etcd's server certificates; TLS is on when set.
        cert / key: PEM client certificate and its private key (etcd's ``--client-cert-auth``);
            both or neither.
        user: etcd user (etcd's ``auth enable``); needs a password.
        password_file: file whose first line is ``user``'s password.
        tls: TLS even without ``cacert`` (an ``https://`` endpoint): the system's CA roots verify
            the server.
        password: the password itself, from ``FTRT_ETCD_PASSWORD``; never printed.
    """

    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""
    tls: bool = False
    password: str = field(default="", repr=False)

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.cacert or self.cert or self.key)

    @property
    def secured(self) -> bool:
        """Whether anything differs from plaintext without auth."""
        return self.uses_tls or bool(self.user)

    @property
    def identifies(self) -> bool:
        """Whether the client proves who it is (a client certificate or an etcd user): only then can
        etcd refuse everyone else."""
        return bool(self.cert or self.user)

    def with_tls(self, on: bool) -> "EtcdAccess":
        return self if not on or self.tls else EtcdAccess(**{**self.__dict__, "tls": True})

    def check(self) -> None:
        """Raise :class:`ConfigError` on the first setting that cannot work (see the module)."""
        if self.cacert:
            check_ca("--etcd-cacert", self.cacert, "etcd's server certificate")
        check_pair("--etcd-cert", self.cert, "--etcd-key", self.key)
        if self.password_file:
            read_file("--etcd-password-file", self.password_file)
        if self.user and not self.password and not self.password_file:
            raise ConfigError(f"--etcd-user {self.user!r} has no password: set {ENV_PASSWORD} or pass "
                              "--etcd-password-file FILE (a password is never taken from the command line).")
        if self.password_file and not self.user:
            raise ConfigError("--etcd-password-file was given without --etcd-user; name the user it belongs to.")

    def secret(self) -> str:
        """The user's password (from the variable, else the file's first line)."""
        if self.password:
            return self.password
        if not self.password_file:
            return ""
        text = read_file("--etcd-password-file", self.password_file).decode("utf-8", "replace")
        line = text.splitlines()[0] if text else ""
        if not line:
            raise ConfigError(f"--etcd-password-file {self.password_file} is empty; put the password of etcd user "
                              f"{self.user!r} on its first line.")
        return line

    def channel_credentials(self):
        """gRPC channel credentials for TLS (call only when :attr:`uses_tls`)."""
        import grpc

        read = (lambda flag, path: read_file(flag, path) if path else None)
        return grpc.ssl_channel_credentials(
            root_certificates=read("--etcd-cacert", self.cacert),
            private_key=read("--etcd-key", self.key),
            certificate_chain=read("--etcd-cert", self.cert),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """An :mod:`ssl` client context with the same files (for etcd's HTTP health endpoint)."""
        ctx = ssl.create_default_context(cafile=self.cacert or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def flags(self) -> list[str]:
        """The ``--etcd-*`` command-line flags that give this access (never the password itself:
        a password from the variable reaches a child through its environment)."""
        given = {"--etcd-cacert": self.cacert, "--etcd-cert": self.cert, "--etcd-key": self.key,
                 "--etcd-user": self.user, "--etcd-password-file": self.password_file}
        return [x for flag, value in given.items() if value for x in (flag, value)]

    def env(self) -> dict[str, str]:
        """The variables that give a child process the same access (paths made absolute; the
        password only as its file's path, or not at all when it came from the variable, which the
        child inherits)."""
        absolute = (lambda p: str(Path(p).absolute()) if p else "")
        env = {ENV_CACERT: absolute(self.cacert), ENV_CERT: absolute(self.cert), ENV_KEY: absolute(self.key),
               ENV_USER: self.user, ENV_PASSWORD_FILE: absolute(self.password_file),
               ENV_TLS: "1" if self.uses_tls else ""}
        if self.password_file:
            env[ENV_PASSWORD] = ""  # the file is the source, in the worker as in the agent
        return env


@dataclass(frozen=True)
class EtcdTarget:
    """Where a job's etcd is and how to reach it: the endpoints (``host:port,...``) and the access."""

    endpoints: str
    access: EtcdAccess = EtcdAccess()


def target_from_env(environ: Mapping[str, str] | None = None) -> EtcdTarget | None:
    """The job's etcd as an agent handed it to its worker (``FTRT_ETCD`` and the access variables),
    or None when the environment names none."""
    e = os.environ if environ is None else environ
    endpoints = e.get(envnames.ETCD, "")
    return EtcdTarget(endpoints, from_env(e)) if endpoints else None


def from_env(environ: Mapping[str, str] | None = None) -> EtcdAccess:
    """The access an agent handed down (see :meth:`EtcdAccess.env`), or an operator's variables."""
    e = os.environ if environ is None else environ
    return EtcdAccess(cacert=e.get(ENV_CACERT, ""), cert=e.get(ENV_CERT, ""), key=e.get(ENV_KEY, ""),
                      user=e.get(ENV_USER, ""), password_file=e.get(ENV_PASSWORD_FILE, ""),
                      tls=e.get(ENV_TLS, "") not in ("", "0"), password=e.get(ENV_PASSWORD, ""))


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The ``--etcd-*`` access flags, the same for every command that talks to etcd."""
    p.add_argument("--etcd-cacert", default=None, metavar="FILE",
                   help="CA that signed etcd's certificates (turns TLS on; also: https:// endpoints)")
    p.add_argument("--etcd-cert", default=None, metavar="FILE", help="client certificate for etcd (PEM)")
    p.add_argument("--etcd-key", default=None, metavar="FILE", help="private key of --etcd-cert (PEM)")
    p.add_argument("--etcd-user", default=None, metavar="NAME",
                   help=f"etcd user; the password comes from ${ENV_PASSWORD} or --etcd-password-file")
    p.add_argument("--etcd-password-file", default=None, metavar="FILE",
                   help="file whose first line is --etcd-user's password")


def from_args(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EtcdAccess:
    """The access the flags of :func:`add_arguments` give, each flag over its variable; checked.
    With none given, the credentials ``ftrt etcd`` left on this host for the endpoint ``--etcd``
    names, if any (:func:`ftrt.store.localetcd.find`)."""
    base = from_env(environ)
    if not (ns.etcd_user or base.user):
        base = EtcdAccess(**{**base.__dict__, "password": ""})  # a stray variable, for some other tool
    access = EtcdAccess(
        cacert=ns.etcd_cacert or base.cacert, cert=ns.etcd_cert or base.cert, key=ns.etcd_key or base.key,
        user=ns.etcd_user or base.user, password_file=ns.etcd_password_file or base.password_file,
        tls=base.tls, password="" if ns.etcd_password_file else base.password,
    )
    endpoints = getattr(ns, "etcd", None)
    if not access.secured and endpoints:
        from ftrt.store import localetcd

        access = localetcd.find(endpoints, environ) or access
    access.check()
    return access
