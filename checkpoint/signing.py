"""Signed manifests: an HMAC-SHA256 that only holders of the job's checkpoint key can make.

Without a key a manifest lists each file's CRC-32, which catches accidents (a torn upload, a bad
disk) fast but is no defence: anyone who can write the bucket can write files and a manifest
that agree. With a key (``ftrt launch --checkpoint-key-file F``, or ``FTRT_CHECKPOINT_KEY``),
every file is summed with SHA-256 instead, and the manifest, files and sums included, is signed
with HMAC-SHA256 under the key. Restore and ``ftrt ckpt verify`` then refuse any checkpoint that
is unsigned or signed under another key, so a writable bucket cannot feed the job foreign weights
(or a foreign pickle in DCP's ``.metadata``, which is read only after its sum matched).

The key is a secret of at least 16 bytes: a file's contents (a trailing newline dropped), or the
variable's text. Workers get the file's path from their agent (``FTRT_CHECKPOINT_KEY_FILE``),
never the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ftrt import envnames
from ftrt.errors import ConfigError

ENV_KEY = envnames.CHECKPOINT_KEY
ENV_KEY_FILE = envnames.CHECKPOINT_KEY_FILE
MIN_KEY_BYTES = 16
SIGNATURE = "hmac-sha256"


@dataclass(frozen=True)
class CheckpointKey:
    """The job's checkpoint key (``where`` names its source for messages, never its bytes)."""

    secret: bytes
    where: str

    def __repr__(self) -> str:
        return f"CheckpointKey(from {self.where})"

    def sign(self, body: bytes) -> str:
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()

    def verifies(self, body: bytes, signature: str) -> bool:
        return hmac.compare_digest(self.sign(body), signature)


def load_key(path: str | None = None, environ: Mapping[str, str] | None = None) -> CheckpointKey | None:
    """The key from ``path`` (``--checkpoint-key-file``), else ``$FTRT_CHECKPOINT_KEY_FILE``, else
    ``$FTRT_CHECKPOINT_KEY``; None when none is configured. A key that cannot be read or is too
    short is a :class:`ConfigError` naming where it came from."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENV_KEY_FILE) or None
    if path:
        where = f"--checkpoint-key-file {path}"
        try:
            secret = Path(path).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(f"{where} cannot be read ({exc.strerror}); give the file that holds the job's "
                              "checkpoint key.") from exc
    elif env.get(ENV_KEY):
        where, secret = f"${ENV_KEY}", env[ENV_KEY].encode()
    else:
        return None
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(f"The checkpoint key from {where} has {len(secret)} bytes; use at least {MIN_KEY_BYTES} "
                          "random bytes (e.g. head -c 32 /dev/urandom | base64 > key).")
    return CheckpointKey(secret, where)
