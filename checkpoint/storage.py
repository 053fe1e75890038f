"""Where checkpoints live: URL parsing, the fsspec filesystem, and DCP's readers and writers.

A checkpoint URL is a local path, ``file://...``, ``s3://bucket/prefix`` or ``memory://name``.
Each checkpoint is a folder ``step-<12 digits>`` under it. This is the one module that touches
DCP's storage classes (``FsspecWriter``/``FsspecReader`` live in a private module of torch), so a
torch upgrade that moves them is a one-file change.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from ftrt.errors import CheckpointUnavailable, ConfigError

_STEP_DIR = re.compile(r"^step-(\d{12})$")
MANIFEST = "manifest.json"


def step_dir(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    if step < 0:
        raise ConfigError(f"A checkpoint step must be >= 0, got {step}.")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint folder name, or None for anything else."""
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclass
class Location:
    """A parsed checkpoint URL: a filesystem and the root path inside it."""

    url: str
    protocol: str
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    fs: Any = None

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def url_of(self, *parts: str) -> str:
        """A URL fsspec (and DCP's fsspec reader/writer) understands."""
        p = self.path(*parts)
        return p if self.is_local else f"{self.protocol}://{p.lstrip('/') if self.protocol != 'memory' else p}"


def parse_url(url: str, storage_options: dict[str, Any] | None = None) -> Location:
    """Parse a checkpoint URL; raise :class:`ConfigError` naming the value when unusable."""
    if not url or not isinstance(url, (str, os.PathLike)):
        raise ConfigError(f"The checkpoint URL {url!r} is empty; give a path, file://, s3:// or memory:// URL.")
    url = os.fspath(url)
    opts = dict(storage_options or {})
    if "://" not in url:
        root = os.path.abspath(url)
        return Location(url, "file", root, opts, fsspec.filesystem("file"))
    protocol, rest = url.split("://", 1)
    if protocol == "file":
        return Location(url, "file", os.path.abspath("/" + rest.lstrip("/")), opts, fsspec.filesystem("file"))
    if protocol == "s3":
        if not rest.strip("/"):
            raise ConfigError(f"The checkpoint URL {url!r} names no bucket; write s3://BUCKET/PREFIX.")
        try:
            fs = fsspec.filesystem("s3", **opts)
        except ImportError as exc:
            raise ConfigError("s3:// checkpoints need s3fs (pip install s3fs).") from exc
        return Location(url, "s3", rest.strip("/"), opts, fs)
    if protocol == "memory":
        return Location(url, "memory", "/" + rest.strip("/"), opts, fsspec.filesystem("memory"))
    raise ConfigError(
        f"The checkpoint URL {url!r} has an unsupported scheme {protocol!r}; use a path, file://, s3:// or memory://."
    )


def dcp_writer(loc: Location, folder: str, thread_count: int = 2):
    """A DCP storage writer for one checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemWriter

    if loc.is_local:
        return FileSystemWriter(loc.path(folder), thread_count=thread_count, overwrite=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(loc.url_of(folder), thread_count=thread_count, overwrite=True, **loc.storage_options)


def dcp_reader(loc: Location, folder: str):
    """A DCP storage reader for one checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemReader

    if loc.is_local:
        return FileSystemReader(loc.path(folder))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(loc.url_of(folder), **loc.storage_options)


def list_steps(loc: Location) -> list[int]:
    """Steps that have a folder under the root (committed or not), ascending."""
    try:
        entries = loc.fs.ls(loc.root, detail=False)
    except FileNotFoundError:
        return []
    steps = [parse_step_dir(e) for e in entries]
    return sorted(s for s in steps if s is not None)


def write_bytes(loc: Location, path: str, data: bytes) -> None:
    """Write a small file so that it appears whole or not at all.

    Local files are written beside and renamed into place; object stores make a single PUT visible
    atomically, so there the object is written directly.
    """
    if loc.is_local:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    else:
        with loc.fs.open(path, "wb") as f:
            f.write(data)


def read_bytes(loc: Location, path: str) -> bytes:
    with loc.fs.open(path, "rb") as f:
        return f.read()


_STORAGE_MODULES = ("botocore", "aiobotocore", "s3fs", "fsspec", "aiohttp")


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the storage (the filesystem, the object store or its client library)
    rather than from ftrt's own code."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _STORAGE_MODULES


def storage_problem(url: str, exc: BaseException) -> CheckpointUnavailable:
    """One clear sentence for a storage failure: what failed and what to do, without the client
    library's traceback."""
    name = type(exc).__name__
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        hint = ("no S3 credentials were found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                "or give them as --storage-options '{\"key\": ..., \"secret\": ...}'")
    elif code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or isinstance(exc, PermissionError):
        hint = f"access was refused ({code or name}). Check the credentials and their permissions on {url}"
    elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError") or isinstance(
            exc, (ConnectionError, TimeoutError)):
        hint = f"the storage could not be reached ({_first_line(exc)}). Check the endpoint and the network"
    else:
        hint = f"{name}: {_first_line(exc)}"
    return CheckpointUnavailable(f"Cannot read the checkpoints at {url}: {hint}.")


def brief(exc: BaseException) -> str:
    """An error in one line for a message or a log line: its type and the first line of its text."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else "")[:300].rstrip(".")
