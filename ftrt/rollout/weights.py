"""Weight pushes on the wire: raw tensor bytes with dtype, shape and SHA-256, never a pickle.

:class:`Outgoing` takes a trainer's state dict apart once per version (one SHA-256 per tensor and
a digest over all of them, which names the version's contents: no other bytes have it);
:func:`chunks` streams it as ``WeightChunk`` messages. On the server, :class:`Assembler` checks
every message against the tensors its policy expects (names, dtypes, shapes, sizes) and every
tensor's SHA-256 before it hands out anything: a push that is truncated, corrupt or of another
model raises :class:`PushRefused`, and the server stays on the version it had. Whether the
trainer made that version is :mod:`ftrt.rollout.claims`' question.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ftrt.errors import FtrtError
from ftrt.v1 import rollout_pb2

PIECE = 1 << 20
"""Bytes of tensor data per message (well under gRPC's 4 MiB default)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class PushRefused(FtrtError):
    """A weight push was incomplete, corrupt or did not fit the server's policy; nothing applied."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise PushRefused(f"Tensors of dtype {dtype} cannot be pushed; use one of {sorted(DTYPES)}.") from None


@dataclass(frozen=True)
class TensorBytes:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    sha256: bytes


def _raw(t: torch.Tensor) -> memoryview:
    """A copy of ``t``'s bytes: the trainer goes on changing its tensors while a push is on its way."""
    flat = t.detach().reshape(-1).clone()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def digest_of(entries: list[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    """A version's identity: SHA-256 over each tensor's name, dtype, shape and SHA-256 (64 hex
    digits: a forged push cannot match it with other bytes)."""
    h = hashlib.sha256()
    for name, dtype, shape, sha in entries:
        h.update(f"{name}|{dtype}|{','.join(map(str, shape))}|{sha.hex()}\n".encode())
    return h.hexdigest()


class Outgoing:
    """One weight version taken apart for pushing: a snapshot of its bytes, SHA-256s and the digest."""

    def __init__(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        self.version = version
        self.created = time.monotonic()
        tensors = []
        for name, t in state.items():
            data = _raw(t.detach().cpu())
            tensors.append(TensorBytes(name, dtype_name(t.dtype), tuple(t.shape), data, hashlib.sha256(data).digest()))
        self.tensors = tensors
        self.digest = digest_of([(t.name, t.dtype, t.shape, t.sha256) for t in tensors])
        self.nbytes = sum(t.data.nbytes for t in tensors)


def chunks(out: Outgoing, keep_from: int, piece: int = PIECE) -> Iterator[rollout_pb2.WeightChunk]:
    """The push as messages: a header, each tensor in pieces (its last with the SHA-256), a commit."""
    yield rollout_pb2.WeightChunk(version=out.version, digest=out.digest, tensors=len(out.tensors),
                                  keep_from=keep_from)
    for t in out.tensors:
        n = t.data.nbytes
        offsets = range(0, n, piece) if n else [0]
        for off in offsets:
            last = off + piece >= n
            yield rollout_pb2.WeightChunk(name=t.name, dtype=t.dtype, shape=t.shape,
                                          data=bytes(t.data[off:off + piece]), last_piece=last,
                                          sha256=t.sha256 if last else b"")
    yield rollout_pb2.WeightChunk(commit=True)


@dataclass(frozen=True)
class Expected:
    """A tensor the server's policy has: what a push must send for it."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


def expected_of(state: Mapping[str, torch.Tensor]) -> dict[str, Expected]:
    return {name: Expected(dtype_name(t.dtype), tuple(t.shape)) for name, t in state.items()}


class Assembler:
    """Takes one push's messages in order and checks each against ``expected``."""

    def __init__(self, expected: Mapping[str, Expected]) -> None:
        self.expected = dict(expected)
        self.version = -1
        self.digest = ""
        self.keep_from = 0
        self.count = -1
        self.done: dict[str, torch.Tensor] = {}
        self.sums: list[tuple[str, str, tuple[int, ...], bytes]] = []
        self._name = ""
        self._buf = bytearray()
        self.received = 0
        self.committed = False

    def feed(self, msg: rollout_pb2.WeightChunk) -> None:
        if self.committed:
            raise PushRefused("The push sent messages after its commit.")
        if self.count < 0:
            if msg.tensors <= 0 or msg.version < 0 or not msg.digest:
                raise PushRefused("The push did not start with a header (version, digest, tensor count).")
            if msg.tensors != len(self.expected):
                raise PushRefused(f"The push holds {msg.tensors} tensors; this server's policy has "
                                  f"{len(self.expected)}: it serves another model (check the trainer's spec).")
            self.version, self.digest, self.count = msg.version, msg.digest, msg.tensors
            self.keep_from = min(msg.keep_from, msg.version)
            return
        if msg.commit:
            self._commit()
            return
        self._piece(msg)

    def _piece(self, msg: rollout_pb2.WeightChunk) -> None:
        name = msg.name
        want = self.expected.get(name)
        if want is None:
            raise PushRefused(f"The push sent a tensor {name!r} that this server's policy does not have.")
        if name in self.done:
            raise PushRefused(f"The push sent tensor {name!r} twice.")
        if self._name and name != self._name:
            raise PushRefused(f"The push began tensor {name!r} before tensor {self._name!r} ended.")
        if msg.dtype != want.dtype or tuple(msg.shape) != want.shape:
            raise PushRefused(f"The push's tensor {name!r} is {msg.dtype}{list(msg.shape)}; this server's policy "
                              f"has {want.dtype}{list(want.shape)}.")
        self._name = name
        self._buf += msg.data
        self.received += len(msg.data)
        if len(self._buf) > want.nbytes:
            raise PushRefused(f"The push sent {len(self._buf)} bytes for tensor {name!r}, which has {want.nbytes}.")
        if not msg.last_piece:
            return
        if len(self._buf) != want.nbytes:
            raise PushRefused(f"The push ended tensor {name!r} after {len(self._buf)} of its {want.nbytes} bytes.")
        sha = hashlib.sha256(self._buf).digest()
        if sha != msg.sha256:
            raise PushRefused(f"Tensor {name!r} arrived with SHA-256 {sha.hex()[:16]}, not the {msg.sha256.hex()[:16]} "
                              "it was sent with: corrupted on the way.")
        t = torch.frombuffer(self._buf, dtype=torch.uint8) if want.nbytes else torch.empty(0, dtype=torch.uint8)
        self.done[name] = t.view(DTYPES[want.dtype]).reshape(want.shape)
        self.sums.append((name, want.dtype, want.shape, sha))
        self._name, self._buf = "", bytearray()

    def _commit(self) -> None:
        if self._name:
            raise PushRefused(f"The push committed in the middle of tensor {self._name!r}.")
        missing = sorted(set(self.expected) - set(self.done))
        if missing:
            raise PushRefused(f"The push committed without {len(missing)} tensor(s), e.g. {missing[0]!r}.")
        digest = digest_of(self.sums)
        if digest != self.digest:
            raise PushRefused(f"The push's tensors add up to digest {digest}, not the {self.digest} announced.")
        self.committed = True

    def result(self) -> dict[str, torch.Tensor]:
        """The pushed tensors, once :meth:`feed` took the commit; a PushRefused before that."""
        if not self.committed:
            got = "no header" if self.count < 0 else f"{len(self.done)} of {self.count} tensors"
            raise PushRefused(f"The push ended before its commit ({got}): the server keeps its old version.")
        return self.done
