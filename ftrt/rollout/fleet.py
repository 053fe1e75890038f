"""The trainer's side of the rollout fleet (rank 0 runs it): discovery, weight pushes, dispatch.

:class:`Fleet` runs on the event loop of a :class:`~ftrt.store.sync.SyncStore` (under ``ftrt
launch`` the one its worker shares for all its etcd users) and offers the trainer a few blocking
calls: :meth:`Fleet.publish` (a new weight version, pushed to every live server),
:meth:`Fleet.submit` (a step's prompt groups with the version they must be sampled with) and
:meth:`Fleet.collect` (that step's completions, once every group has exactly one result).

In the background a pump, several times a second:

- claims in etcd every version it may push, with its digest, under a lease of its own
  (:mod:`ftrt.rollout.claims`: a server takes only a claimed version), and pushes a version only
  once it is claimed;
- reads the servers' records in etcd (a server appears when it registers, goes when its lease
  does) and pushes each usable server every version the ledger still needs, newest first;
- sends waiting groups to the least-loaded server that holds their version (:func:`route`);
- takes a group back when its server dies (the call fails at once: the connection resets),
  refuses it (FAILED_PRECONDITION: it does not hold the version) or misses ``request_timeout``
  (hung): the group waits again and goes elsewhere, and a server that missed a deadline or a
  push serves nothing until it answers a probe or takes a good push;
- fails :meth:`collect` with :class:`RolloutUnavailable` when no usable server has been there
  for ``wait_timeout`` while groups wait, instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Mapping

import grpc
import grpc.aio
import numpy as np
import torch

from ftrt.auth import job_token
from ftrt.errors import FtrtError, StoreError
from ftrt.jobkeys import JobKeys
from ftrt.rollout.claims import VersionClaims
from ftrt.rollout.ledger import GroupKey, Ledger, ServerView, next_push, route
from ftrt.rollout.records import ServerRecord
from ftrt.rollout.server import MAX_MESSAGE
from ftrt.policy.spec import PolicySpec
from ftrt.rollout.weights import Outgoing, chunks
from ftrt.store.sync import SyncStore
from ftrt.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger("ftrt.rollout.fleet")

REFRESH_S = 0.5
"""How often the pump reads the servers' records."""
PROBE_S = 1.0
"""How often a server out of routing is probed (and the probe's deadline)."""


class RolloutUnavailable(FtrtError):
    """No rollout server could serve the trainer for longer than ``rollout.wait_timeout``."""


class BadReply(Exception):
    """A server's answer did not fit the request (wrong group, shape or token ids)."""


@dataclass(frozen=True)
class PushStats:
    version: int
    seconds: float
    bytes: int
    servers: int


@dataclass
class _PushTally:
    started: float
    last: float = 0.0
    bytes: int = 0
    servers: int = 0


@dataclass
class _Server:
    record: ServerRecord
    lease: int
    """The lease its record is under: a server that registers again comes back under another."""
    channel: grpc.aio.Channel
    stub: rollout_pb2_grpc.RolloutServiceStub
    versions: dict[int, str]
    usable: bool = True
    why: str = ""
    probe_at: float = 0.0
    push_at: float = 0.0
    pushing: asyncio.Task | None = None
    calls: set = field(default_factory=set)
    detail: str = ""
    """The last push failure, for the error that ends a starved run."""


class Fleet:
    """Rank 0's link to the job's rollout servers (see the module docstring)."""

    def __init__(self, *, store: SyncStore, own_store: bool = False, job_id: str, spec: PolicySpec, vocab_size: int,
                 max_new: int, request_timeout: float, wait_timeout: float, push_timeout: float,
                 per_server: int = 2) -> None:
        self.keys = JobKeys(job_id)
        self.spec = spec
        self.shape = (spec.group_size, max_new)
        self.vocab_size = vocab_size
        self.request_timeout = request_timeout
        self.wait_timeout = wait_timeout
        self.push_timeout = push_timeout
        self.per_server = per_server
        self.ledger = Ledger()
        self.versions: dict[int, Outgoing] = {}
        self.servers: dict[str, _Server] = {}
        self._pushes: dict[int, _PushTally] = {}
        self._dead: dict[str, int] = {}
        """Servers dropped as dead, by id, with the lease of the record they had: that record is
        ignored until it goes (its lease outlives the process by up to a TTL); a server that
        registers again (a new lease) is welcome."""
        self._foreign: set[str] = set()
        """Servers of another policy spec (warned about once)."""
        self._closing: set[asyncio.Task] = set()
        self._claiming: asyncio.Task | None = None
        """The write of the claims in progress (one at a time)."""
        self.error: Exception | None = None
        self._starved_since: float | None = None
        self._closed = False
        self._sync = store
        self._own_store = own_store
        """Whether :meth:`close` closes ``store`` too (one the fleet was given for itself)."""
        self._loop = store.loop
        self._store = store.store
        try:
            self.token = self._run(job_token(self._store, self.keys))
            self._run(self._store.put(self.keys.rollout_spec, spec.encode(), timeout=5.0))
            self._claims = self._run(VersionClaims.start(self._store, self.keys))
        except BaseException:
            self.close()
            raise
        self._wake = self._run(self._make_event())
        self._progress = self._run(self._make_event())
        self._pump_task = asyncio.run_coroutine_threadsafe(self._pump(), self._loop)

    # -- the trainer's calls (any thread but the fleet's) ------------------------------------------------
    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    def publish(self, version: int, state: Mapping[str, torch.Tensor], keep_from: int) -> None:
        """Make ``state`` weight version ``version``: it is pushed to every usable server in the
        background, and a group of this version goes to a server as soon as that server holds it.
        Versions below ``keep_from`` that no group needs any more are dropped."""
        out = Outgoing(version, state)
        self._run(self._publish(out, keep_from))

    def push_stats(self, version: int) -> PushStats:
        """How the push of ``version`` went so far: seconds from :meth:`publish` until the last server
        that took it acknowledged it, bytes sent, servers that hold it."""
        tally = self._pushes.get(version)
        if tally is None:
            return PushStats(version, 0.0, 0, 0)
        return PushStats(version, tally.last - tally.started if tally.servers else 0.0, tally.bytes, tally.servers)

    def submit(self, step: int, prompt_ids: list[int], version: int) -> None:
        """Ask for step ``step``'s groups, sampled with weights ``version``."""
        self._loop.call_soon_threadsafe(self._submit, step, prompt_ids, version)

    def seed(self, step: int, results: dict[int, torch.Tensor], version: int) -> None:
        """Step ``step``'s groups, already sampled (from a checkpoint)."""
        self._run(self._seed(step, results, version))

    def collect(self, step: int, *, keep: bool = False) -> tuple[dict[int, torch.Tensor], int]:
        """Step ``step``'s completions by prompt id, waiting for all of them, and how many groups
        were sent again; the step leaves the ledger unless ``keep``."""
        return self._run(self._collect(step, keep))

    @property
    def live(self) -> int:
        """Usable servers now (read on the fleet's loop)."""
        return self._run(self._live())

    async def _live(self) -> int:
        return sum(1 for s in self.servers.values() if s.usable)

    def close(self) -> None:
        """Stop the pump and close every connection. Idempotent."""
        if self._closed or self._loop.is_closed():
            return
        self._closed = True
        try:
            self._run(self._shutdown(), timeout=10)
        finally:
            if self._own_store:
                self._sync.close()

    # -- on the fleet's loop -------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        pump = asyncio.wrap_future(self._pump_task) if hasattr(self, "_pump_task") else None
        if pump is not None:
            self._pump_task.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        for s in list(self.servers.values()):
            self._drop(s, "fleet closed")
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._claiming is not None:
            self._claiming.cancel()
            await asyncio.gather(self._claiming, return_exceptions=True)
        claims = getattr(self, "_claims", None)
        if claims is not None:
            await claims.close()

    def _submit(self, step: int, prompt_ids: list[int], version: int) -> None:
        if version not in self.versions:
            raise AssertionError(f"version {version} was not published")
        self.ledger.add(step, prompt_ids, version)
        self._wake.set()

    async def _seed(self, step: int, results: dict[int, torch.Tensor], version: int) -> None:
        self.ledger.seed(step, results, version)

    async def _publish(self, out: Outgoing, keep_from: int) -> None:
        self.versions[out.version] = out
        self._pushes[out.version] = _PushTally(time.monotonic())
        needed = self.ledger.needed_versions() | {out.version}
        for v in [v for v in self.versions if v < keep_from and v not in needed]:
            del self.versions[v]
        for v in [v for v in self._pushes if v not in self.versions]:
            del self._pushes[v]
        self._wake.set()

    async def _collect(self, step: int, keep: bool) -> tuple[dict[int, torch.Tensor], int]:
        while not self.ledger.done(step):
            if self.error is not None:
                raise self.error
            if not self.ledger.has(step):
                raise AssertionError(f"step {step} was never submitted")
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        results, redone = self.ledger.results(step), self.ledger.redispatched.get(step, 0)
        if not keep:
            self.ledger.forget(step)
        return results, redone

    async def _pump(self) -> None:
        next_refresh = 0.0
        while not self._closed:
            now = time.monotonic()
            if now >= next_refresh:
                await self._refresh()
                next_refresh = time.monotonic() + REFRESH_S
            self._claim()
            self._reconcile(now)
            self._dispatch(now)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.1)
            except asyncio.TimeoutError:
                pass

    async def _refresh(self) -> None:
        try:
            kvs, _ = await self._store.get_prefix(self.keys.rollout_servers, timeout=2.0)
        except StoreError as exc:
            log.warning("cannot read the rollout servers from etcd: %s", exc)
            return
        seen = set()
        for kv in kvs:
            try:
                rec = ServerRecord.decode(kv.value)
            except (ValueError, KeyError, TypeError, FtrtError) as exc:
                log.warning("ignoring a malformed rollout server record at %s: %s", kv.key, exc)
                continue
            if kv.key != self.keys.rollout_server(rec.server_id):
                log.warning("ignoring the record at %s: it names server %s", kv.key, rec.server_id)
                continue
            seen.add(rec.server_id)
            if self._dead.get(rec.server_id) == kv.lease:
                continue
            self._dead.pop(rec.server_id, None)
            if rec.spec_digest != self.spec.digest:
                if rec.server_id not in self._foreign:
                    self._foreign.add(rec.server_id)
                    log.warning("ignoring rollout server %s: it serves policy spec %s, not this trainer's %s "
                                "(restart it to serve this run)", rec.server_id, rec.spec_digest, self.spec.digest)
                continue
            self._foreign.discard(rec.server_id)
            old = self.servers.get(rec.server_id)
            if old is not None and (old.record.addr != rec.addr or old.record.pid != rec.pid or old.lease != kv.lease):
                self._drop(old, "registered again")
                old = None
            if old is None:
                channel = grpc.aio.insecure_channel(rec.addr, options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])
                self.servers[rec.server_id] = _Server(rec, kv.lease, channel,
                                                      rollout_pb2_grpc.RolloutServiceStub(channel), dict(rec.versions))
                log.info("rollout server %s at %s joined (holds versions %s)", rec.server_id, rec.addr,
                         sorted(rec.versions))
                self._wake.set()
        for sid in [sid for sid in self.servers if sid not in seen]:
            self._drop(self.servers[sid], "its lease is gone")
        for sid in [sid for sid in self._dead if sid not in seen]:
            del self._dead[sid]
        self._foreign &= seen

    def _drop(self, s: _Server, why: str, *, dead: bool = False) -> None:
        if self.servers.get(s.record.server_id) is s:
            del self.servers[s.record.server_id]
        if dead:
            self._dead[s.record.server_id] = s.lease
        for key in self.ledger.release(s.record.server_id):  # its groups wait again, whatever its tasks do
            log.info("group %s of %s goes to another server", key, s.record.server_id)
        if not self._closed:
            log.warning("rollout server %s left the fleet: %s", s.record.server_id, why)
        for task in list(s.calls):
            task.cancel()
        if s.pushing is not None:
            s.pushing.cancel()
        closing = asyncio.get_running_loop().create_task(s.channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _bench(self, s: _Server, why: str) -> None:
        if s.usable:
            log.warning("rollout server %s taken out of routing: %s", s.record.server_id, why)
        s.usable, s.why = False, why
        s.probe_at = time.monotonic() + PROBE_S

    def _reconcile(self, now: float) -> None:
        """Push missing versions to usable servers; probe the benched; notice starvation."""
        needed = sorted(self.versions, reverse=True)
        for s in list(self.servers.values()):
            if not s.usable and s.why != "push failed" and now >= s.probe_at and s.pushing is None:
                s.probe_at = now + 10 * PROBE_S  # one probe at a time
                s.pushing = asyncio.get_running_loop().create_task(self._probe(s))
                continue
            if s.pushing is not None or now < s.push_at:
                continue
            target = self._next_version(s, needed)
            if target is not None and (s.usable or s.why == "push failed"):
                s.pushing = asyncio.get_running_loop().create_task(self._push(s, self.versions[target]))
        waiting = bool(self.ledger.waiting()) or bool(self.ledger.inflight())
        if waiting and not any(s.usable for s in self.servers.values()):
            if self._starved_since is None:
                self._starved_since = now
                log.warning("no usable rollout server; groups wait (up to rollout.wait_timeout = %g s)",
                            self.wait_timeout)
            elif now - self._starved_since > self.wait_timeout and self.error is None:
                why = "; ".join(f"{s.record.server_id}: {s.detail or s.why}" for s in self.servers.values())
                foreign = f"; ignored (another policy spec): {', '.join(sorted(self._foreign))}" if self._foreign else ""
                self.error = RolloutUnavailable(
                    f"No rollout server of job {self.keys.job_id} could serve for {self.wait_timeout:g} s "
                    f"(rollout.wait_timeout) ({why or 'none registered'}{foreign}); start some with: ftrt rollout "
                    f"serve --etcd ... --job-id {self.keys.job_id}.")
                self._progress.set()
        else:
            self._starved_since = None

    def _claim(self) -> None:
        """Claim every version the fleet may push now, unless etcd holds exactly those already."""
        if self._claimed() or (self._claiming is not None and not self._claiming.done()):
            return
        want = {v: out.digest for v, out in self.versions.items()}
        self._claiming = asyncio.get_running_loop().create_task(self._write_claims(want))

    def _claimed(self) -> bool:
        """Whether etcd holds exactly the versions the fleet may push now, under a live lease."""
        return self._claims.claimed == {v: out.digest for v, out in self.versions.items()} and \
            not self._claims.lapsed()

    async def _write_claims(self, want: dict[int, str]) -> None:
        try:
            await self._claims.publish(want)
        except StoreError as exc:
            log.warning("cannot claim weight versions %s in etcd (%s); their pushes wait", sorted(want), exc)
            await asyncio.sleep(0.5)
        finally:
            self._wake.set()

    def _next_version(self, s: _Server, needed: list[int]) -> int | None:
        if not self._claimed():
            return None  # a version is not claimed yet (a moment after publish): its servers would refuse it
        held = {v for v, d in s.versions.items() if v in self.versions and self.versions[v].digest == d}
        return next_push(s.record.max_versions, held, needed, self.ledger.needed_versions() & set(self.versions))

    async def _probe(self, s: _Server) -> None:
        try:
            info = await s.stub.Info(rollout_pb2.InfoRequest(), timeout=PROBE_S)
            stuck = info.generating_s > self.request_timeout  # its engine still sits on an old group
            if not info.fenced and not stuck and s.why != "push failed":
                s.versions = {v: d for v, d in s.versions.items() if v in set(info.held)}
                s.usable, s.why = True, ""
                log.info("rollout server %s answers again; back in routing", s.record.server_id)
                self._wake.set()
        except grpc.aio.AioRpcError:
            pass
        finally:
            s.probe_at = time.monotonic() + PROBE_S
            s.pushing = None

    async def _push(self, s: _Server, out: Outgoing) -> None:
        keep_from = min(self.versions)
        try:
            reply = await s.stub.PushWeights(chunks(out, keep_from), timeout=self.push_timeout,
                                             metadata=self.token.metadata())
            held = set(reply.held)
            s.versions = {v: d for v, d in s.versions.items() if v in held}
            s.versions[out.version] = out.digest
            tally = self._pushes.get(out.version)
            if tally is not None:
                tally.last, tally.servers, tally.bytes = time.monotonic(), tally.servers + 1, tally.bytes + out.nbytes
            if not s.usable and s.why == "push failed":
                s.usable, s.why = True, ""
                log.info("rollout server %s took version %d; back in routing", s.record.server_id, out.version)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED and out.version not in self.versions:
                log.info("version %d was dropped while its push to %s was on its way (the server refused it, "
                         "as the trainer no longer claims it)", out.version, s.record.server_id)
                return
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                self._claims.forget()  # the server found no claim of ours: write them again before the next push
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._drop(s, f"unreachable during a push ({exc.details()})", dead=True)
            else:
                self._bench(s, "push failed")
                s.detail = f"push of version {out.version} refused: {exc.details()}"
                log.warning("push of version %d to %s failed: %s %s", out.version, s.record.server_id,
                            exc.code().name, exc.details())
            s.push_at = time.monotonic() + 1.0
        finally:
            s.pushing = None
            self._progress.set()
            self._wake.set()

    def _dispatch(self, now: float) -> None:
        for key, sid in self.ledger.overdue(now):
            s = self.servers.get(sid)
            if s is not None:
                self._bench(s, f"missed the {self.request_timeout:g} s deadline of a group")
            self.ledger.failed(key, sid)
        views = [ServerView(s.record.server_id, frozenset(v for v, d in s.versions.items()
                                                          if v in self.versions and self.versions[v].digest == d),
                            0, s.usable) for s in self.servers.values()]
        inflight = self.ledger.inflight()
        views = [ServerView(v.server_id, v.versions, inflight.get(v.server_id, 0), v.usable) for v in views]
        waiting = self.ledger.waiting()
        versions = dict(waiting)
        for key, sid in route(waiting, views, self.per_server):
            s = self.servers[sid]
            version = versions[key]
            # the ledger's deadline is a backstop a little after the call's own
            self.ledger.sent(key, sid, now + self.request_timeout + 0.5)
            task = asyncio.get_running_loop().create_task(self._call(s, key, version))
            s.calls.add(task)
            task.add_done_callback(s.calls.discard)

    async def _call(self, s: _Server, key: GroupKey, version: int) -> None:
        sid = s.record.server_id
        req = rollout_pb2.GenerateRequest(step=key.step, prompt_id=key.prompt_id, version=version,
                                          weights_digest=self.versions[version].digest)
        try:
            reply = await s.stub.Generate(req, timeout=self.request_timeout, metadata=self.token.metadata())
            tokens = self._check(reply, key, version)
            self.ledger.answered(key, sid, tokens)
        except asyncio.CancelledError:
            self.ledger.failed(key, sid)
            raise
        except BadReply as exc:
            self._bench(s, f"bad answer: {exc}")
            self.ledger.failed(key, sid)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self._drop(s, f"died or fenced while sampling ({exc.details()})", dead=True)
            elif code == grpc.StatusCode.FAILED_PRECONDITION:
                s.versions.pop(version, None)
            else:
                self._bench(s, f"{code.name}: {exc.details()}")
            self.ledger.failed(key, sid)
        finally:
            self._progress.set()
            self._wake.set()

    def _check(self, reply, key: GroupKey, version: int) -> torch.Tensor:
        g, n = self.shape
        if (reply.step, reply.prompt_id, reply.version) != (key.step, key.prompt_id, version):
            raise BadReply(f"answered step {reply.step} prompt {reply.prompt_id} version {reply.version} for "
                           f"step {key.step} prompt {key.prompt_id} version {version}")
        if (reply.group, reply.width) != (g, n) or len(reply.tokens) != g * n * 4:
            raise BadReply(f"{reply.group}x{reply.width} tokens ({len(reply.tokens)} bytes), not {g}x{n}")
        ids = torch.from_numpy(np.frombuffer(reply.tokens, dtype="<i4").astype(np.int64)).view(g, n)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise BadReply(f"token ids outside the vocabulary of {self.vocab_size}")
        return ids
