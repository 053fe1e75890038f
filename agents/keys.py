"""The etcd key layout of a job. Everything a job writes lives under ``/ftrt/<job_id>/``.

``rdzv/`` holds what the rendezvous watches (one watch per agent covers it); events and
checkpoint pointers live beside it so their traffic does not wake the rendezvous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ftrt.errors import ConfigError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_id(kind: str, value: str) -> str:
    """Validate a job or node id (letters, digits, ``. _ -``; at most 128 characters)."""
    if not _ID.match(value):
        raise ConfigError(
            f"The {kind} {value!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    return value


@dataclass(frozen=True)
class JobKeys:
    """Key names for one job."""

    job_id: str

    @property
    def root(self) -> str:
        return f"/ftrt/{self.job_id}/"

    @property
    def rdzv(self) -> str:
        """Prefix the rendezvous watches."""
        return f"{self.root}rdzv/"

    @property
    def nodes(self) -> str:
        return f"{self.rdzv}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    @property
    def round(self) -> str:
        return f"{self.rdzv}round"

    @property
    def requests(self) -> str:
        return f"{self.rdzv}requests/"

    def request(self, node_id: str) -> str:
        return f"{self.requests}{node_id}"

    @property
    def masters(self) -> str:
        return f"{self.rdzv}master/"

    def master(self, round_no: int) -> str:
        return f"{self.masters}{round_no:012d}"

    @property
    def state(self) -> str:
        """The job's terminal state (succeeded / failed)."""
        return f"{self.rdzv}state"

    @property
    def events(self) -> str:
        return f"{self.root}events/"

    @property
    def ckpt(self) -> str:
        return f"{self.root}ckpt/"
