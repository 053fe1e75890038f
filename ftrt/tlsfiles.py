"""Reading and checking PEM files named on a command line (TLS for etcd and for agents).

Each check raises one :class:`~ftrt.errors.ConfigError` naming the flag and the file, so that a
wrong path, an empty CA or a key that does not belong to its certificate is a clear line at
start-up rather than a failed handshake later.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from ftrt.errors import ConfigError


def read_file(flag: str, path: str) -> bytes:
    """The bytes of ``path``, or a :class:`ConfigError` saying why ``flag``'s file cannot be read."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"{flag} {path} does not exist; give the path of an existing file.") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{flag} {path} is a directory; give the path of a file.") from exc
    except PermissionError as exc:
        raise ConfigError(f"{flag} {path} cannot be read by this user ({exc.strerror}); fix its permissions.") from exc
    except OSError as exc:
        raise ConfigError(f"{flag} {path} cannot be read ({exc.strerror}).") from exc


def check_ca(flag: str, path: str, what: str) -> None:
    """``path`` holds at least one PEM CA certificate (``what``: what it must have signed)."""
    read_file(flag, path)
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{flag} {path} holds no usable PEM CA certificate ({exc}); give the CA file that "
                          f"signed {what}.") from exc


def check_pair(cert_flag: str, cert: str, key_flag: str, key: str) -> None:
    """``cert`` and ``key`` are both given, readable, and a certificate with its own private key."""
    if bool(cert) != bool(key):
        given, missing = (cert_flag, key_flag) if cert else (key_flag, cert_flag)
        raise ConfigError(f"{given} was given without {missing}: a certificate needs its private key and the key "
                          "its certificate; pass both or neither.")
    if not cert:
        return
    read_file(cert_flag, cert)
    read_file(key_flag, key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(f"{cert_flag} {cert} and {key_flag} {key} are not a PEM certificate and its matching "
                          f"private key ({exc.reason or exc}); check both files.") from exc
