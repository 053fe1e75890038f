"""The checkpoint manifest: plain JSON, written last, listing every file with size and checksum.

A checkpoint folder without a complete, valid manifest does not exist for restore. DCP's own
``.metadata`` is a pickle and DCP keeps no checksums, so the manifest covers ``.metadata`` too, and
restore verifies every file against it before DCP is allowed to read anything.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Iterable

from ftrt._version import __version__
from ftrt.checkpoint.storage import MANIFEST, Location
from ftrt.errors import CheckpointCorrupt

FORMAT = "ftrt-checkpoint/1"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: str


@dataclass
class Manifest:
    """What a committed checkpoint holds."""

    step: int
    world_size: int
    files: dict[str, FileEntry]
    round: int = 0
    time: float = 0.0
    ftrt_version: str = __version__
    format: str = FORMAT
    extra: dict = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = asdict(self)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Manifest":
        """Parse and validate; raise :class:`CheckpointCorrupt` naming ``where`` and the fault."""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise CheckpointCorrupt(f"The manifest {where} is not valid JSON ({exc}); it is truncated or damaged.") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CheckpointCorrupt(f"The manifest {where} is not an {FORMAT} manifest.")
        try:
            files = {
                name: FileEntry(int(v["size"]), str(v["crc32"])) for name, v in body["files"].items()
            }
            return cls(
                step=int(body["step"]), world_size=int(body["world_size"]), files=files,
                round=int(body.get("round", 0)), time=float(body.get("time", 0.0)),
                ftrt_version=str(body.get("ftrt_version", "")), extra=dict(body.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorrupt(f"The manifest {where} is missing or has a bad field ({exc!r}).") from None


def checksum_file(loc: Location, path: str) -> FileEntry:
    """Size and CRC-32 of one stored file, read in chunks."""
    crc = 0
    size = 0
    with loc.fs.open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileEntry(size, f"{crc:08x}")


def verify_files(loc: Location, folder: str, manifest: Manifest, names: Iterable[str]) -> None:
    """Check the named files of ``manifest`` exist with the recorded size and checksum."""
    for name in names:
        want = manifest.files[name]
        path = loc.path(folder, name)
        try:
            size = loc.fs.size(path)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"Checkpoint step {manifest.step}: file {name} is missing.") from None
        if size != want.size:
            raise CheckpointCorrupt(
                f"Checkpoint step {manifest.step}: file {name} has {size} bytes, the manifest says {want.size}."
            )
        got = checksum_file(loc, path)
        if got.crc32 != want.crc32:
            raise CheckpointCorrupt(
                f"Checkpoint step {manifest.step}: file {name} has checksum {got.crc32}, the manifest says {want.crc32}."
            )


def read_manifest(loc: Location, folder: str) -> Manifest:
    """Read and parse a folder's manifest; :class:`CheckpointCorrupt` if absent or invalid."""
    path = loc.path(folder, MANIFEST)
    try:
        with loc.fs.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{folder} has no manifest: the save never committed.") from None
    return Manifest.from_json(raw, f"{folder}/{MANIFEST}")
