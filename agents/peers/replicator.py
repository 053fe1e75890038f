"""Peer replication of memory checkpoints: each node's newest arenas copied to K other nodes.

When a worker reports a complete memory checkpoint (:class:`ftrt.reports.MemorySaved`), the
agent streams that rank's arena (index first, then the bytes in 1 MiB chunks) to each of its K
ring successors in the current round (``--replicas K``, default 1) with
:meth:`AgentService.PutReplica`. Before the stream's last message, the SHA-256 of the index and
bytes, the agent claims the checkpoint in etcd (:mod:`.claims`): its receiver stores only a
replica its owner claimed. With K copies, any K nodes lost at once, adjacent ones included,
leave a copy of each lost node's ranks on a survivor. Replication is latest-wins per rank: a
checkpoint superseded before its turn is skipped. The receiver writes into the alternate slot of
``replicas/<node>/rank-<r>/`` and publishes the index only when every byte arrived, matched the SHA-256 the sender computed as it read them
(the stream's last message) and matched the sender's claim, so a torn, damaged or forged transfer
never replaces a good replica. After the loss of a node, the survivors' workers find
that node's arenas among their own node's replicas (:func:`ftrt.checkpoint.memtier.scan`).

A sharded rank is sent after every checkpoint: its shards exist nowhere else. A rank whose
checkpoint holds every tensor whole (data parallel) is sent at most every ``--replica-interval``
seconds (default 10): every survivor's own copy already covers a lost node
(:func:`ftrt.checkpoint.memtier.choose`), so its replica is only a spare, and sending each step's
copy cost each agent 5-15 % of a core here (docs/benchmarks.md, overhead).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Mapping

import grpc
import grpc.aio

from ftrt.auth import JobToken
from ftrt.jobkeys import check_id
from ftrt.agents.peers.claims import Claim, ClaimBook, ReplicaGate, hasher
from ftrt.privatefiles import private_dir, private_file
from ftrt.tmpdirs import owned_dir
from ftrt.agents.peers.tls import PLAINTEXT, PeerChannels
from ftrt.checkpoint.memfiles import current_slot, invalidate_slot, publish_index
from ftrt.checkpoint.memindex import check_index
from ftrt.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

CHUNK = 1 << 20


def make_mem_dir() -> str:
    """The node's memory-tier directory on tmpfs (``/dev/shm``) when there is one, private (0700):
    the job's weights, which no other local user reads or plants. Named for this agent's pid, so
    that the next agent on this machine removes it if this one is killed (:mod:`ftrt.tmpdirs`)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return owned_dir("ftrt-mem-", base or os.environ.get("TMPDIR", "/tmp"))


class Replicator:
    """Sends this node's newest memory checkpoints to its replica peers (``--replicas K``: the K
    ring successors in the current round), each over its own :class:`_PeerLink`."""

    def __init__(self, node_id: str, mem_dir: str, token: JobToken, claims: ClaimBook, interval: float = 0.0,
                 channels: PeerChannels | None = None) -> None:
        self.node_id = node_id
        self.claims = claims
        """Where each copy is claimed before its last message goes (:mod:`.claims`)."""
        self.channels = channels if channels is not None else PeerChannels(PLAINTEXT)
        """Where the links' channels come from (shared with the liveness streams, kept across rounds)."""
        self.mem_dir = mem_dir
        self.token = token
        self.interval = interval
        """Seconds between two sends of a rank whose checkpoint holds every tensor whole (the newest
        goes). A data-parallel rank's copy only backs up what every survivor holds too; a sharded
        rank's goes after every checkpoint, as a lost node's shards exist nowhere else."""
        self._links: dict[str, _PeerLink] = {}
        self._closing: set[asyncio.Task] = set()
        self._pruned_for: frozenset[int] = frozenset()

    @property
    def peers(self) -> list[str]:
        """The agent addresses replicas go to now."""
        return list(self._links)

    @property
    def sends(self) -> dict[int, int]:
        """Copies sent, per rank, to every peer together."""
        out: dict[int, int] = {}
        for link in self._links.values():
            for rank, n in link.sends.items():
                out[rank] = out.get(rank, 0) + n
        return out

    @property
    def sent_bytes(self) -> int:
        return sum(link.sent_bytes for link in self._links.values())

    def replicated(self) -> dict[int, int] | None:
        """Per rank, the newest step every peer has received (the worst-placed copy counts); None
        without peers."""
        if not self._links:
            return None
        links = list(self._links.values())
        ranks = set().union(*(link.last_sent for link in links))
        return {r: min(link.last_sent.get(r, -1) for link in links) for r in ranks}

    def set_peers(self, addrs: list[str]) -> None:
        """Replicate to exactly ``addrs`` from now on: a new peer gets every rank's newest copy, a
        peer no longer listed is dropped (its send in progress is cancelled)."""
        for addr in [a for a in self._links if a not in addrs]:
            task = asyncio.get_running_loop().create_task(self._links.pop(addr).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for addr in addrs:
            if addr and addr not in self._links:
                link = _PeerLink(self, addr)
                self._links[addr] = link
                link.notify_all()

    def notify(self, rank: int) -> None:
        """``rank`` has a new memory checkpoint: every peer gets it (latest-wins)."""
        for link in self._links.values():
            link.notify(rank)

    def prune(self, held: set[int]) -> list[int]:
        """Remove this node's memory checkpoints of the ranks none of its workers holds any more
        (they took another rank in place, e.g. ranks 2-3 became 1-2 when a node before them left),
        once every rank held has one of a later round than theirs, which supersedes them: nothing
        restores from the older round's then. Returns the ranks removed. Cheap when nothing changed
        (the set of ranks held is remembered once pruned for)."""
        if not held or frozenset(held) == self._pruned_for:
            return []
        own = Path(self.mem_dir) / "own"
        rounds: dict[int, int | None] = {}
        for directory in own.glob("rank-*"):
            try:
                rank = int(directory.name.split("-")[1])
            except ValueError:
                continue
            try:
                rounds[rank] = int(json.loads((directory / "current.json").read_text())["round"])
            except (OSError, ValueError, KeyError, TypeError):
                rounds[rank] = None
        if any(rounds.get(r) is None for r in held):
            return []  # a rank held has no checkpoint yet: an older one may still be the newest
        oldest_held = min(rounds[r] for r in held)  # type: ignore[type-var]
        stale = sorted(r for r, rnd in rounds.items() if r not in held and (rnd is None or rnd < oldest_held))
        for rank in stale:
            shutil.rmtree(own / f"rank-{rank}", ignore_errors=True)
            for link in self._links.values():
                link.forget(rank)
        if stale:
            log.info("removed the memory checkpoints of rank(s) %s, which this node's workers no longer hold",
                     ", ".join(map(str, stale)))
        if all(r in held or r in stale for r in rounds):
            self._pruned_for = frozenset(held)  # nothing is left to remove for this set of ranks
        return stale

    def _newest(self) -> dict[int, tuple[int, bool]]:
        """Per own rank: the step of its newest memory checkpoint and whether every tensor is whole."""
        out = {}
        for directory in (Path(self.mem_dir) / "own").glob("rank-*"):
            try:
                index = json.loads((directory / "current.json").read_text())
                whole = all(e["local_shape"] == e["global_shape"] for e in index["entries"])
                out[int(directory.name.split("-")[1])] = (int(index["step"]), whole)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no complete checkpoint of that rank yet
        return out

    async def flush(self, timeout: float) -> bool:
        """Before this node leaves (a drain): send every sharded rank's newest memory checkpoint to
        every peer now, interval or not, and wait up to ``timeout`` s. True once each is there (or
        there is none); False past the timeout or without a peer. A data-parallel rank needs no
        copy: every staying rank saved the same step of the same tensors."""
        sharded = {r: step for r, (step, whole) in self._newest().items() if not whole}
        if not sharded:
            return True
        if not self._links:
            return False
        for link in self._links.values():
            link.send_now(sharded)
        deadline = time.monotonic() + timeout
        while any(link.last_sent.get(r, -1) < step for link in self._links.values() for r, step in sharded.items()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.close() for link in links), *self._closing, return_exceptions=True)


class _PeerLink:
    """Replication to one peer agent: latest-wins per rank, one gRPC channel, one task."""

    def __init__(self, owner: Replicator, peer: str) -> None:
        self.owner = owner
        self.peer = peer
        self._sent_at: dict[int, float] = {}
        self._whole: dict[int, bool] = {}
        self._dirty: set[int] = set()
        self._wake = asyncio.Event()
        self.sent_bytes = 0
        self.sends: dict[int, int] = {}
        """Copies sent to this peer, per rank."""
        self.last_sent: dict[int, int] = {}
        """The step last sent, per rank."""
        self._sent_key: dict[int, tuple[int, int, int]] = {}
        """(step, round, world) last sent, per rank: a rank's directory may hold a later round's
        checkpoint of the same step (its worker took another rank in place), which must go too."""
        self._channel = owner.channels.get(peer)
        """The channel to the peer, kept across sends (a new one per send cost milliseconds) and
        owned by :class:`~ftrt.agents.peers.tls.PeerChannels`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"replicate-to-{peer}")

    def notify_all(self) -> None:
        """A new peer has none of our checkpoints yet."""
        for p in (Path(self.owner.mem_dir) / "own").glob("rank-*"):
            self._dirty.add(int(p.name.split("-")[1]))
        self._wake.set()

    def notify(self, rank: int) -> None:
        self._dirty.add(rank)
        self._wake.set()

    def forget(self, rank: int) -> None:
        """``rank``'s checkpoints were removed here: nothing of it is due any more."""
        for held in (self._sent_at, self._whole, self.last_sent, self._sent_key, self.sends):
            held.pop(rank, None)
        self._dirty.discard(rank)

    def send_now(self, ranks) -> None:
        """Send ``ranks`` next, however recently they were sent."""
        for rank in ranks:
            self._sent_at.pop(rank, None)
            self._dirty.add(rank)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                now = time.monotonic()
                due = {r: self._sent_at.get(r, -1e9) + (self.owner.interval if self._whole.get(r) else 0.0)
                       for r in self._dirty}
                rank = min(due, key=lambda r: (due[r], r))
                if due[rank] > now:  # every dirty rank was sent less than `interval` ago
                    try:
                        await asyncio.wait_for(self._wake.wait(), due[rank] - now)
                        self._wake.clear()
                    except asyncio.TimeoutError:
                        pass
                    continue
                self._dirty.discard(rank)
                self._sent_at[rank] = now
                try:
                    await self._send(rank)
                except Exception as exc:  # noqa: BLE001 - one failed copy must not end this peer's replication
                    log.warning("replicating rank %d's memory checkpoint to %s failed: %s", rank, self.peer,
                                f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                                else exc)

    async def _send(self, rank: int) -> None:
        directory = Path(self.owner.mem_dir) / "own" / f"rank-{rank}"
        index = json.loads((directory / "current.json").read_text())
        self._whole[rank] = all(e["local_shape"] == e["global_shape"] for e in index["entries"])
        key = (int(index["step"]), int(index.get("round", 0)), int(index.get("world", 0)))
        if self._sent_key.get(rank) == key:
            return
        path = directory / f"slot-{index['slot']}.bin"
        t0 = time.monotonic()

        index_json = json.dumps(index)
        failed: list[Exception] = []

        async def chunks():
            # An exception raised here would only cancel the call (grpc.aio logs it at debug level,
            # and the caller gets a bare CancelledError): it is kept for _send to raise instead, and
            # the stream ends without its checksum, which the receiver refuses.
            try:
                yield agent_pb2.ReplicaChunk(source_node=self.owner.node_id, rank=rank, step=index["step"],
                                             index_json=index_json)
                digest = hasher(index_json)
                with open(path, "rb") as f:
                    sent = 0
                    while sent < index["size"]:
                        data = await asyncio.to_thread(_read_hash, f, min(CHUNK, index["size"] - sent), digest)
                        if not data:
                            break
                        sent += len(data)
                        yield agent_pb2.ReplicaChunk(data=data)
                # The slot must not have been reused while we read it, or the copy is torn.
                if current_slot(directory) != index["slot"] and _previous_slot(directory) != index["slot"]:
                    raise ValueError(f"rank {rank}'s arena slot was reused during replication")
                sha = digest.hexdigest()
                await self.owner.claims.publish(rank, Claim(*key, size=sent, sha256=sha))
            except Exception as exc:  # noqa: BLE001 - raised by _send, once the call has ended
                failed.append(exc)
                return
            yield agent_pb2.ReplicaChunk(sha256=sha)

        stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        try:
            ack = await stub.PutReplica(chunks(), timeout=300, metadata=self.owner.token.metadata())
        except grpc.aio.AioRpcError:
            if failed:
                raise failed[0] from None  # why the stream ended short, not the receiver's refusal of it
            raise
        if failed:
            raise failed[0]
        self.sent_bytes += ack.bytes
        self.sends[rank] = self.sends.get(rank, 0) + 1
        self.last_sent[rank] = index["step"]
        self._sent_key[rank] = key
        log.debug("replicated rank %d step %d (%d bytes) to %s in %.2f s", rank, index["step"], ack.bytes,
                  self.peer, time.monotonic() - t0)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _read_hash(f, n: int, digest) -> bytes:
    data = f.read(n)
    digest.update(data)
    return data


def _write_hash(f, data: bytes, digest) -> None:
    f.write(data)
    digest.update(data)


def _previous_slot(directory: Path) -> int | None:
    try:
        return json.loads((directory / "previous.json").read_text())["slot"]
    except (OSError, ValueError, KeyError):
        return None


def replica_dir(mem_dir: str, chunk: agent_pb2.ReplicaChunk) -> tuple[Path, dict]:
    """Where a replica stream's header says to store it, and its checked index. Every name from
    the wire is checked before it becomes part of a path (ValueError otherwise): the source is a
    node id, the rank and step those of the index, which :func:`check_index` accepts."""
    source = check_id("source node", chunk.source_node)
    try:
        index = check_index(json.loads(chunk.index_json))
    except ValueError as exc:
        raise ValueError(f"the replica of rank {chunk.rank} from {source} has an invalid index: {exc}") from None
    if (index["rank"], index["step"]) != (chunk.rank, chunk.step):
        raise ValueError(f"the replica's header (rank {chunk.rank}, step {chunk.step}) does not match its index "
                         f"(rank {index['rank']}, step {index['step']})")
    return Path(mem_dir) / "replicas" / source / f"rank-{index['rank']}", index


async def receive_replica(mem_dir: str, request_iterator, gate: ReplicaGate,
                          auth_context: Mapping[str, list[bytes]]) -> agent_pb2.ReplicaAck:
    """Store one replica stream (the server side of ``PutReplica``) if ``gate`` admits it: its
    owner claimed exactly these bytes (:mod:`.claims`). ``auth_context`` is the call's, whose
    certificate (under mutual TLS) must name the source node."""
    header = None
    f = None
    path = None  # the file being written, until it becomes a slot
    received = 0
    digest = None
    claimed: str | None = None
    arriving = contextlib.ExitStack()
    try:
        async for chunk in request_iterator:
            if header is None:
                header = chunk
                directory, index = replica_dir(mem_dir, chunk)
                arriving.enter_context(gate.stream(header.source_node, index["rank"], index["size"], mem_dir))
                # Into a file of its own: a stream that is refused, torn or concurrent with another
                # (a caller with the token may send one at any time) touches no slot until admitted.
                path = private_dir(directory) / f".incoming-{uuid.uuid4().hex}"
                f = private_file(path)
                digest = hasher(chunk.index_json)
            if claimed is not None:
                raise ValueError(f"the replica of rank {header.rank} step {header.step} went on after its checksum")
            if chunk.data:
                if received + len(chunk.data) > index["size"]:
                    raise ValueError(f"the replica of rank {header.rank} step {header.step} sent more than the "
                                     f"{index['size']} bytes its index gives")
                await asyncio.to_thread(_write_hash, f, chunk.data, digest)
                received += len(chunk.data)
            if chunk.sha256:
                claimed = chunk.sha256
        if header is None:
            return agent_pb2.ReplicaAck(bytes=0)
        f.close()
        f = None
        if received != index["size"]:
            raise ValueError(f"replica of rank {header.rank} step {header.step} ended after {received} "
                             f"of {index['size']} bytes")
        sha = digest.hexdigest()
        if claimed != sha:
            raise ValueError(f"the replica of rank {header.rank} step {header.step} "
                             + ("carried no checksum" if claimed is None else
                                f"does not match its checksum (sent {claimed[:12]!r}, received {sha[:12]})"))
        claim = Claim(index["step"], index["round"], index["world"], received, sha)
        await gate.admit(header.source_node, index["rank"], claim, auth_context)
        held = _held_key(directory)
        if held is not None and (index["round"], index["step"]) < held:
            gate.refuse(header.source_node, index["rank"], claim, f"it is older than the replica held (step {held[1]} "
                        f"of round {held[0]}): an old copy replayed would push the newer ones out")
        _install(directory, path, index)
        path = None
        return agent_pb2.ReplicaAck(bytes=received)
    finally:
        arriving.close()
        if f is not None:
            f.close()
        if path is not None:  # a torn or refused stream leaves no bytes behind, nor a folder it made
            path.unlink(missing_ok=True)
            for folder in (path.parent, path.parent.parent):
                try:
                    folder.rmdir()
                except OSError:
                    break  # not empty: it holds replicas


def _held_key(directory: Path) -> tuple[int, int] | None:
    """(round, step) of the newest replica held in ``directory``, or None."""
    try:
        held = json.loads((directory / "current.json").read_text())
        return int(held["round"]), int(held["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _install(directory: Path, incoming: Path, index: dict) -> None:
    """Make ``incoming`` the newest replica in ``directory``: it takes the slot the previous one
    holds (that one goes), and its index is published. No await in between: two streams that end
    together are installed one after the other."""
    now = current_slot(directory)
    slot = 0 if now is None else 1 - now
    invalidate_slot(directory, slot)
    os.replace(incoming, directory / f"slot-{slot}.bin")
    index.pop("file", None)
    index["slot"] = slot
    publish_index(directory, index)
