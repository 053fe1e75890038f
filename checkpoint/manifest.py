"""The checkpoint manifest: plain JSON, written last, listing every file with size and checksum.

A checkpoint folder without a complete, valid manifest does not exist for restore. DCP's own
``.metadata`` is a pickle and DCP keeps no checksums, so the manifest covers ``.metadata`` too, and
restore verifies every file against it before DCP is allowed to read anything.

``checksum`` says how files are summed: ``crc32`` (fast; guards against accidents) or, when the job
has a checkpoint key, ``sha256``, and then ``signature`` is the HMAC-SHA256 of the rest of the
manifest under the key (:mod:`ftrt.checkpoint.signing`). :func:`check_signature` is the one
place that decides whether a manifest may be trusted under a key.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

from ftrt._version import __version__
from ftrt.checkpoint.signing import SIGNATURE, CheckpointKey
from ftrt.checkpoint.storage import MANIFEST, Location, step_dir
from ftrt.errors import CheckpointCorrupt

FORMAT = "ftrt-checkpoint/1"
_CHUNK = 8 << 20


CHECKSUMS = ("crc32", "sha256")


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: str = ""
    sha256: str = ""

    def digest(self, checksum: str) -> str:
        return self.sha256 if checksum == "sha256" else self.crc32


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
    checksum: str = "crc32"
    signature: str = ""
    """``hmac-sha256:<hex>`` over :meth:`signed_bytes`, or empty (unsigned)."""

    def to_json(self) -> bytes:
        body = asdict(self)
        for entry in body["files"].values():  # only the sum the manifest uses
            for name in CHECKSUMS:
                if name != self.checksum:
                    entry.pop(name)
        if not self.signature:
            body.pop("signature")
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    def signed_bytes(self) -> bytes:
        """What the signature covers: every field but the signature, in one canonical form."""
        body = json.loads(self.to_json())
        body.pop("signature", None)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, key: CheckpointKey) -> "Manifest":
        if self.checksum != "sha256":
            raise ValueError("only a manifest of SHA-256 sums may be signed (a CRC-32 can be forged)")
        return Manifest(**{**self.__dict__, "signature": f"{SIGNATURE}:{key.sign(self.signed_bytes())}"})

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
        checksum = body.get("checksum", "crc32")
        if checksum not in CHECKSUMS:
            raise CheckpointCorrupt(f"The manifest {where} sums its files with {checksum!r}, which this ftrt does "
                                    f"not know (it knows {', '.join(CHECKSUMS)}).")
        try:
            files = {
                name: FileEntry(int(v["size"]), **{checksum: str(v[checksum])}) for name, v in body["files"].items()
            }
            return cls(
                step=int(body["step"]), world_size=int(body["world_size"]), files=files,
                round=int(body.get("round", 0)), time=float(body.get("time", 0.0)),
                ftrt_version=str(body.get("ftrt_version", "")), extra=dict(body.get("extra", {})),
                checksum=checksum, signature=str(body.get("signature", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorrupt(f"The manifest {where} is missing or has a bad field ({exc!r}).") from None


def checksum_file(loc: Location, path: str, checksum: str = "crc32") -> FileEntry:
    """Size and sum (``crc32`` or ``sha256``) of one stored file, read in chunks."""
    crc = 0
    sha = hashlib.sha256() if checksum == "sha256" else None
    size = 0
    with loc.fs.open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            if sha is not None:
                sha.update(chunk)
            else:
                crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileEntry(size, sha256=sha.hexdigest()) if sha is not None else FileEntry(size, f"{crc:08x}")


def check_signature(manifest: Manifest, key: CheckpointKey | None, where: str) -> None:
    """Raise :class:`CheckpointCorrupt` unless ``manifest`` may be trusted: with a key, only a
    manifest of SHA-256 sums signed under that key; without one, any valid manifest."""
    if key is None:
        return
    if not manifest.signature:
        raise CheckpointCorrupt(f"{where} is not signed, but a checkpoint key is configured ({key.where}): it was "
                                "not written by a job holding the key, so it is not trusted.")
    scheme, _, mac = manifest.signature.partition(":")
    if scheme != SIGNATURE or manifest.checksum != "sha256" or not key.verifies(manifest.signed_bytes(), mac):
        raise CheckpointCorrupt(f"{where} has a signature that does not match the configured checkpoint key "
                                f"({key.where}): it was written or changed by someone without the key, so it is "
                                "not trusted.")


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
        got = checksum_file(loc, path, manifest.checksum).digest(manifest.checksum)
        if got != want.digest(manifest.checksum):
            raise CheckpointCorrupt(
                f"Checkpoint step {manifest.step}: file {name} has {manifest.checksum} checksum {got}, the manifest "
                f"says {want.digest(manifest.checksum)}."
            )


def verify_step(loc: Location, folder: str, key: CheckpointKey | None = None, *,
                name_of: Callable[[int], str] = step_dir) -> Manifest:
    """The one check of a stored step, as ``ftrt ckpt verify`` and the chaos invariants make it: its
    manifest is read (and its signature checked when ``key`` is given), then every file it lists
    must exist with its size and checksum. Restore makes the same check with the files shared
    out over the ranks (:func:`verify_files` on each rank's share). Raises
    :class:`CheckpointCorrupt` with the first reason found."""
    manifest = read_manifest(loc, folder, key, name_of=name_of)
    verify_files(loc, folder, manifest, sorted(manifest.files))
    return manifest


def read_manifest(loc: Location, folder: str, key: CheckpointKey | None = None, *,
                  name_of: Callable[[int], str] = step_dir) -> Manifest:
    """Read and parse a folder's manifest; :class:`CheckpointCorrupt` if absent or invalid, or
    (with ``key``) not signed under it, or found in a folder not named ``name_of(its step)``."""
    path = loc.path(folder, MANIFEST)
    try:
        with loc.fs.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{folder} has no manifest: the save never committed.") from None
    m = Manifest.from_json(raw, f"{folder}/{MANIFEST}")
    check_signature(m, key, f"The checkpoint {folder}")
    named = folder.rstrip("/").rsplit("/", 1)[-1]
    if named != name_of(m.step):
        raise CheckpointCorrupt(f"The manifest in {folder} is the one of step {m.step}: a checkpoint copied under "
                                "another step's name is not trusted.")
    return m
