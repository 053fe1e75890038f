"""A rollout server's record in etcd: the one owner of its JSON fields (torch-free, so ``ftrt
status`` reads it without importing torch).

A record comes from etcd, which is not trusted to hold only what servers wrote: :meth:`decode`
checks every field (the id as a job id is checked, the address as HOST:PORT) and raises
ValueError otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ftrt.jobkeys import check_id


@dataclass(frozen=True)
class ServerRecord:
    """A server's registration in etcd (JSON; the one owner of its fields)."""

    server_id: str
    addr: str
    engine: str
    versions: dict[int, str]
    """The weight versions held, with their digests."""
    pid: int
    max_versions: int = 1
    """How many versions the engine can hold at once (vLLM: 1)."""
    spec_digest: str = ""
    """The policy spec it serves (:attr:`ftrt.policy.spec.PolicySpec.digest`): a trainer uses only
    servers of its own spec."""

    def encode(self) -> bytes:
        data = {**self.__dict__, "versions": {str(v): d for v, d in self.versions.items()}}
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "ServerRecord":
        """A record from etcd, checked field by field; ValueError if it is not one."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        rec = cls(server_id=check_id("rollout server id", data.get("server_id")), addr=str(data["addr"]),
                  engine=str(data["engine"]),
                  versions={int(v): str(d) for v, d in dict(data["versions"]).items()}, pid=int(data["pid"]),
                  max_versions=int(data.get("max_versions", 1)), spec_digest=str(data.get("spec_digest", "")))
        if not 1 <= rec.max_versions <= 64:
            raise ValueError(f"max_versions {rec.max_versions} is not 1-64")
        host, _, port = rec.addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address {rec.addr!r} is not HOST:PORT")
        return rec
