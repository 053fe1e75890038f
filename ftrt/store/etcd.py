"""The etcd implementation of :class:`~ftrt.store.api.Store`.

It speaks etcd's v3 gRPC API through the protocol stubs that ``aetcd`` ships (``aetcd.rpc``), on a
channel of our own. We do not use ``aetcd.Client`` itself because it has one timeout for every call
(including watch streams), connects to a single host, and ends watches on a server restart; ftrt
needs per-call deadlines, failover between cluster members and watches that resume from the last
revision they delivered. See docs/design.md, "etcd layer".

Failure handling:

- The channel holds every endpoint (``ipv4:a:p,b:q``) with gRPC's ``round_robin`` policy, so
  a call goes to a member that is up; a member's death costs the calls in flight on it, which are
  retried on another member.
- Every unary call runs under a deadline (the store's ``timeout``, or the call's own) split in
  attempts of at most ``attempt_timeout`` seconds; transient failures (member down, leader change,
  no leader, attempt deadline) are retried with a short backoff until the deadline, then raise
  :class:`~ftrt.errors.StoreUnavailable`. A transaction retried after an attempt timed out may
  have landed: callers of compare-and-swap re-read after a failed compare, which covers it.
- Watches run on their own stream per watch with ``hasleader`` set (a member cut off from the
  quorum ends the stream instead of going silent) and progress notifications; when the stream
  breaks they re-watch from the revision after the last one delivered, so no event is lost.

Security (:class:`~ftrt.store.access.EtcdAccess`): with TLS the channel verifies etcd's
certificate against the given CA (by the host name of the first endpoint) and presents the
client certificate when one is given. With a user, the store authenticates once, sends etcd's
token with every call and stream, and authenticates again when etcd says the token expired. A
failed handshake or a refused user is a :class:`~ftrt.errors.ConfigError` at once, not a retry
until the deadline: no waiting fixes a wrong CA or password.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from typing import AsyncIterator, Sequence

import grpc
import grpc.aio
from aetcd import rpc

from ftrt.errors import ConfigError, LeaseLost, StoreError, StoreUnavailable, WatchCompacted
from ftrt.store.access import ENV_PASSWORD, EtcdAccess
from ftrt.store.api import Compare, Delete, Get, KeyValue, Lease, Op, Put, TxnResult, WatchEvent

log = logging.getLogger(__name__)

_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,  # connection torn down mid-call shows up as UNKNOWN at times
    grpc.StatusCode.INTERNAL,  # "RST_STREAM" when a member dies mid-call
}
_LEASE_NOT_FOUND = "requested lease not found"
_TOKEN_EXPIRED = ("invalid auth token", "auth token", "revision of auth store is old")
"""etcd's words for a token to replace: expired or unknown, or issued before an RBAC change."""
_WATCH_DENIED = "permission denied"  # etcd < 3.5.5 cancels a watch with a stale token this way
_AUTH_NOT_ENABLED = "authentication is not enabled"
_HANDSHAKE = ("handshake", "CERTIFICATE_VERIFY_FAILED", "certificate verify failed", "WRONG_VERSION_NUMBER",
              "tlsv1 alert", "alert certificate")
_COMPARE_RESULT = {
    "==": rpc.Compare.EQUAL,
    "!=": rpc.Compare.NOT_EQUAL,
    "<": rpc.Compare.LESS,
    ">": rpc.Compare.GREATER,
}
_COMPARE_TARGET = {
    "value": (rpc.Compare.VALUE, "value"),
    "mod": (rpc.Compare.MOD, "mod_revision"),
    "create": (rpc.Compare.CREATE, "create_revision"),
    "version": (rpc.Compare.VERSION, "version"),
    "lease": (rpc.Compare.LEASE, "lease"),
}


def unreachable(endpoints: str, seconds: float, *, standalone: bool = False) -> StoreUnavailable:
    """The one error every command gives when etcd did not answer: where, for how long, what to do
    (``standalone``: also mention ``--standalone``, for ``ftrt launch``)."""
    return StoreUnavailable(f"Cannot reach etcd at {endpoints} within {seconds:g} s. Start etcd there (ftrt etcd)"
                            + (", fix --etcd, or use --standalone for a single-node job." if standalone
                               else " or fix --etcd."))


def endpoints_use_tls(spec: str | Sequence[str]) -> bool:
    """Whether the endpoints are written ``https://`` (all of them or none; a mix is an error)."""
    items = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if x.strip()]
    secure = [x.startswith("https://") for x in items]
    if any(secure) and not all(secure):
        raise ConfigError(f"The etcd endpoints {','.join(items)!r} mix https:// and plain ones; one cluster "
                          "speaks TLS on every member or on none, so write them all alike.")
    return bool(secure) and all(secure)


def parse_endpoints(spec: str | Sequence[str]) -> list[tuple[str, int]]:
    """Parse ``"host:port,host:port"`` (or a list of ``host:port``) into (host, port) pairs.

    An ``http://`` or ``https://`` prefix is accepted (etcd prints its endpoints that way);
    :func:`endpoints_use_tls` tells which it was.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        host, sep, port = item.rpartition(":")
        if sep and host and port.isdigit() and not 0 < int(port) < 65536:
            raise ConfigError(f"The etcd endpoint {raw.strip()!r} has port {port}, which is not a port; "
                              "give one of 1-65535, e.g. 127.0.0.1:2379.")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                f"The etcd endpoint {raw.strip()!r} is not HOST:PORT; "
                "give endpoints as HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:2379."
            )
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ConfigError("No etcd endpoint was given; pass --etcd HOST:PORT[,HOST:PORT...].")
    return out


def _grpc_target(endpoints: list[tuple[str, int]]) -> str:
    """A gRPC target naming every endpoint by address, so one channel can fail over."""
    v4: list[str] = []
    v6: list[str] = []
    for host, port in endpoints:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ConfigError(
                f"The etcd host {host!r} does not resolve ({exc.strerror}); check --etcd."
            ) from exc
        for family, _, _, _, addr in infos:
            if family == socket.AF_INET:
                v4.append(f"{addr[0]}:{port}")
                break
            if family == socket.AF_INET6:
                v6.append(f"[{addr[0]}]:{port}")
                break
    if v4:
        return "ipv4:" + ",".join(dict.fromkeys(v4))
    return "ipv6:" + ",".join(dict.fromkeys(v6))


def _range_end(prefix: bytes) -> bytes:
    raw = bytearray(prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"


class _Backoff:
    """Retries until a deadline: 20 ms doubling to 200 ms between attempts."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.delay = 0.02

    def spent(self) -> bool:
        """Whether another wait would pass the deadline."""
        return time.monotonic() + self.delay >= self.deadline

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.2)


def _kv(kv) -> KeyValue:
    return KeyValue(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


class EtcdStore:
    """A :class:`~ftrt.store.api.Store` on an etcd v3 cluster.

    Args:
        endpoints: ``"host:port[,host:port...]"`` or a list of ``"host:port"``.
        timeout: default deadline of one call, in seconds.
        attempt_timeout: longest single attempt inside a call's deadline.
        access: TLS files and etcd user (see :mod:`ftrt.store.access`); ``https://`` endpoints
            turn TLS on with the system's CA roots when no CA file is given.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = 3.0,
        attempt_timeout: float = 1.0,
        access: EtcdAccess = EtcdAccess(),
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.access = access.with_tls(endpoints_use_tls(endpoints))
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self._target = _grpc_target(self.endpoints)
        self._channel: grpc.aio.Channel | None = None
        self._closed = False
        self._watch_calls: set = set()
        self._keepalive_calls: dict[int, grpc.aio.StreamStreamCall] = {}
        self._keepalive_locks: dict[int, asyncio.Lock] = {}
        """One per lease: a stream has one renewal in flight; leases sharing the store never wait
        for each other (simulation mode runs hundreds of leases on one store)."""
        self.errors = 0
        """Failed call attempts so far, retried or not (``ftrt_etcd_errors_total``)."""
        self._connected = False  # a call succeeded: a handshake failure from now on is transient
        self._token = ""  # etcd's auth token, when access names a user; "" until the first call
        self._auth_lock = asyncio.Lock()

    def __repr__(self) -> str:
        eps = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"EtcdStore({eps})"

    @property
    def endpoint_text(self) -> str:
        """The endpoints as ``host:port,...``, for messages."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # -- connection -----------------------------------------------------------------------------
    def _chan(self) -> grpc.aio.Channel:
        if self._closed:
            raise StoreUnavailable(f"The etcd store for {self.endpoint_text} is closed.")
        if self._channel is None:
            options = [
                    ("grpc.lb_policy_name", "round_robin"),
                    ("grpc.initial_reconnect_backoff_ms", 50),
                    ("grpc.min_reconnect_backoff_ms", 50),
                    ("grpc.max_reconnect_backoff_ms", 500),
                    # etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time).
                    ("grpc.keepalive_time_ms", 5000),
                    ("grpc.keepalive_timeout_ms", 2000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.enable_retries", 0),
            ]
            if self.access.uses_tls:
                # The target names members by address; their certificates name the host the user wrote.
                options.append(("grpc.ssl_target_name_override", self.endpoints[0][0]))
                self._channel = grpc.aio.secure_channel(self._target, self.access.channel_credentials(),
                                                        options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self._target, options=options)
            self._auth_stub = rpc.AuthStub(self._channel)
            self._kv_stub = rpc.KVStub(self._channel)
            self._lease_stub = rpc.LeaseStub(self._channel)
            self._watch_stub = rpc.WatchStub(self._channel)
            self._maint_stub = rpc.MaintenanceStub(self._channel)
        return self._channel

    async def _metadata(self, deadline: float, stale: str = "") -> tuple[tuple[str, str], ...]:
        """The call metadata: etcd's auth token when a user is configured (fetched on first use,
        and again when ``stale`` is the token etcd just refused). Opens the channel."""
        self._chan()
        if not self.access.user:
            return ()
        async with self._auth_lock:
            if not self._token or self._token == stale:
                self._token = await self._authenticate(deadline)
        return (("token", self._token),) if self._token != "-" else ()

    async def _authenticate(self, deadline: float) -> str:
        """etcd's token for the configured user ("-" when etcd has auth off: calls go without one)."""
        req = rpc.AuthenticateRequest(name=self.access.user, password=self.access.secret())
        backoff = _Backoff(deadline)
        while True:
            self._chan()
            remaining = deadline - time.monotonic()
            try:
                resp = await self._auth_stub.Authenticate(req, timeout=max(0.01, min(remaining, self.attempt_timeout)))
                return resp.token
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if _AUTH_NOT_ENABLED in details:
                    log.warning("etcd at %s has auth disabled; --etcd-user %r is not needed and is not used",
                                self.endpoint_text, self.access.user)
                    return "-"
                self._check_handshake(exc)
                if exc.code() not in _TRANSIENT:
                    raise ConfigError(
                        f"etcd at {self.endpoint_text} refused user {self.access.user!r} ({details}); check "
                        f"--etcd-user and the password ({ENV_PASSWORD} or --etcd-password-file)."
                    ) from exc
                if backoff.spent():
                    raise StoreUnavailable(
                        f"etcd at {self.endpoint_text} did not authenticate user {self.access.user!r} in time "
                        f"(last error: {exc.code().name}: {details}). Check that etcd is running and reachable."
                    ) from exc
                await backoff.wait()

    def _check_handshake(self, exc: grpc.aio.AioRpcError) -> None:
        """Raise a :class:`ConfigError` when ``exc`` is a failed TLS handshake (or plaintext
        meeting TLS): a wrong CA, a server certificate for another name, a missing client
        certificate. Waiting does not fix those."""
        details = exc.details() or ""
        if self._connected or exc.code() != grpc.StatusCode.UNAVAILABLE or not any(m in details for m in _HANDSHAKE):
            return  # once connected, a failed handshake is a member restarting: retried like any outage
        if self.access.uses_tls:
            hint = (f"check that --etcd-cacert {self.access.cacert or '(system roots)'} is the CA that signed "
                    f"etcd's certificate, that the certificate names {self.endpoints[0][0]!r}, that etcd serves "
                    "TLS on this port, and that a client certificate (--etcd-cert/--etcd-key) is given if "
                    "etcd requires one")
        else:
            hint = "etcd serves TLS on this port: write the endpoints https://HOST:PORT or pass --etcd-cacert"
        raise ConfigError(f"The TLS handshake with etcd at {self.endpoint_text} failed ({details.strip()}); "
                          f"{hint}.") from exc

    async def _unary(self, what: str, method_name: str, stub_name: str, request, timeout):
        """Run one unary RPC with retries of transient failures until the deadline."""
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        backoff = _Backoff(deadline)
        stale = ""
        while True:
            metadata = await self._metadata(deadline, stale)
            method = getattr(getattr(self, stub_name), method_name)
            remaining = deadline - time.monotonic()
            try:
                resp = await method(request, timeout=max(0.01, min(remaining, self.attempt_timeout)),
                                    metadata=metadata)
                self._connected = True
                return resp
            except grpc.aio.AioRpcError as exc:
                self.errors += 1
                if self._token_refused(exc) and time.monotonic() < deadline:
                    stale = self._token  # expired (etcd's --auth-token-ttl): authenticate again
                    continue
                self._check_handshake(exc)
                if exc.code() not in _TRANSIENT:
                    raise self._translate(exc, what) from exc
                if backoff.spent():
                    raise StoreUnavailable(
                        f"etcd at {self.endpoint_text} did not complete {what} within "
                        f"{budget:.1f} s (last error: {exc.code().name}: {exc.details()}). "
                        "Check that etcd is running and reachable"
                        f"{'' if self.access.uses_tls else ', and if it serves TLS write https:// endpoints'}."
                    ) from exc
                log.debug("etcd %s failed (%s); retrying in %.2f s", what, exc.code().name, backoff.delay)
                await backoff.wait()

    def _token_refused(self, exc: grpc.aio.AioRpcError) -> bool:
        details = exc.details() or ""
        return bool(self.access.user) and exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                                         grpc.StatusCode.INVALID_ARGUMENT) \
            and any(m in details for m in _TOKEN_EXPIRED)

    def _translate(self, exc: grpc.aio.AioRpcError, what: str) -> StoreError:
        details = exc.details() or ""
        if _LEASE_NOT_FOUND in details:
            return LeaseLost(f"etcd refused {what}: the lease does not exist (expired or revoked).")
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED or "user name is empty" in details:
            who = (f"user {self.access.user!r}" if self.access.user else
                   "a client without --etcd-user (under TLS etcd takes the client certificate's common name as "
                   "the user)")
            return StoreError(f"etcd refused {what} to {who}: {details}. Grant the user's role read and write on "
                              "the prefix /ftrt/ (etcdctl role grant-permission --prefix ROLE readwrite /ftrt/).")
        return StoreError(f"etcd refused {what}: {exc.code().name}: {details}.")

    # -- key-value ------------------------------------------------------------------------------
    async def get(self, key: str, *, timeout: float | None = None) -> tuple[KeyValue | None, int]:
        req = rpc.RangeRequest(key=key.encode())
        resp = await self._unary(f"get {key!r}", "Range", "_kv_stub", req, timeout)
        return (_kv(resp.kvs[0]) if resp.kvs else None), resp.header.revision

    async def get_prefix(
        self, prefix: str, *, timeout: float | None = None
    ) -> tuple[list[KeyValue], int]:
        raw = prefix.encode()
        req = rpc.RangeRequest(
            key=raw,
            range_end=_range_end(raw),
            sort_order=rpc.RangeRequest.ASCEND,
            sort_target=rpc.RangeRequest.KEY,
        )
        resp = await self._unary(f"get prefix {prefix!r}", "Range", "_kv_stub", req, timeout)
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    async def last_created(
        self, prefix: str, max_create_revision: int, *, timeout: float | None = None
    ) -> tuple[KeyValue | None, int]:
        if max_create_revision < 1:  # etcd reads 0 as "no limit"
            _, revision = await self.get(prefix, timeout=timeout)
            return None, revision
        raw = prefix.encode()
        req = rpc.RangeRequest(
            key=raw, range_end=_range_end(raw), limit=1, max_create_revision=max_create_revision,
            sort_order=rpc.RangeRequest.DESCEND, sort_target=rpc.RangeRequest.CREATE,
        )
        resp = await self._unary(f"last created under {prefix!r}", "Range", "_kv_stub", req, timeout)
        return (_kv(resp.kvs[0]) if resp.kvs else None), resp.header.revision

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None
    ) -> int:
        req = rpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = await self._unary(f"put {key!r}", "Put", "_kv_stub", req, timeout)
        return resp.header.revision

    async def delete(self, key: str, *, timeout: float | None = None) -> bool:
        req = rpc.DeleteRangeRequest(key=key.encode())
        resp = await self._unary(f"delete {key!r}", "DeleteRange", "_kv_stub", req, timeout)
        return resp.deleted > 0

    async def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        raw = prefix.encode()
        req = rpc.DeleteRangeRequest(key=raw, range_end=_range_end(raw))
        resp = await self._unary(
            f"delete prefix {prefix!r}", "DeleteRange", "_kv_stub", req, timeout
        )
        return resp.deleted

    @staticmethod
    def _compare(c: Compare):
        target, field = _COMPARE_TARGET[c.target]
        msg = rpc.Compare(result=_COMPARE_RESULT[c.op], target=target, key=c.key.encode())
        setattr(msg, field, c.operand)
        return msg

    @staticmethod
    def _op(op: Op):
        raw = op.key.encode()
        if isinstance(op, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=op.value, lease=op.lease))
        end = _range_end(raw) if op.prefix else b""
        if isinstance(op, Delete):
            return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=raw, range_end=end))
        if isinstance(op, Get):
            return rpc.RequestOp(
                request_range=rpc.RangeRequest(
                    key=raw,
                    range_end=end,
                    sort_order=rpc.RangeRequest.ASCEND,
                    sort_target=rpc.RangeRequest.KEY,
                )
            )
        raise TypeError(f"Unknown transaction operation {op!r}.")

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        req = rpc.TxnRequest(
            compare=[self._compare(c) for c in compare],
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        )
        keys = ",".join(sorted({c.key for c in compare}))
        resp = await self._unary(f"transaction on {keys!r}", "Txn", "_kv_stub", req, timeout)
        results: list = []
        for r in resp.responses:
            kind = r.WhichOneof("response")
            if kind == "response_range":
                results.append([_kv(kv) for kv in r.response_range.kvs])
            else:
                results.append(None)
        return TxnResult(resp.succeeded, resp.header.revision, results)

    # -- leases ---------------------------------------------------------------------------------
    async def grant_lease(self, ttl: float, *, timeout: float | None = None) -> Lease:
        req = rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)))
        resp = await self._unary("lease grant", "LeaseGrant", "_lease_stub", req, timeout)
        if resp.error:
            raise StoreError(f"etcd refused a lease of {ttl} s: {resp.error}.")
        return Lease(resp.ID, float(resp.TTL))

    async def keep_alive(self, lease_id: int, *, timeout: float | None = None) -> float:
        """Renew ``lease_id`` once and return its new TTL, on one long-lived keep-alive stream per
        lease (as etcd's own clients do): a renewal is a message on an open stream, not a new one.
        A stream that fails or stays silent for ``attempt_timeout`` is dropped and opened again
        within the deadline."""
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        backoff = _Backoff(deadline)
        stale = ""
        lock = self._keepalive_locks.setdefault(lease_id, asyncio.Lock())
        async with lock:  # one request in flight per stream: answers come in order
            while True:
                metadata = await self._metadata(deadline, stale)
                call = self._keepalive_calls.get(lease_id)
                if call is None:
                    call = self._lease_stub.LeaseKeepAlive(metadata=metadata)
                    self._keepalive_calls[lease_id] = call
                wait = max(0.01, min(deadline - time.monotonic(), self.attempt_timeout))
                try:
                    # Both halves are bounded: a write on a stream whose member died can block as
                    # long as a read can (an etcd leader loss in a 3-member cluster showed it).
                    resp = await asyncio.wait_for(_renew_once(call, lease_id), wait)
                    if resp is grpc.aio.EOF:
                        raise StoreUnavailable("etcd closed the keep-alive stream")
                except asyncio.CancelledError:
                    self._drop_keepalive(lease_id)  # its answer may still come: never read it as the next one's
                    raise
                except (grpc.aio.AioRpcError, asyncio.TimeoutError, TimeoutError, StoreUnavailable, grpc.aio.UsageError,
                        asyncio.InvalidStateError) as exc:  # the last: a write on a stream the server ended
                    self._drop_keepalive(lease_id)
                    self.errors += 1
                    if isinstance(exc, grpc.aio.AioRpcError):
                        if self._token_refused(exc) and time.monotonic() < deadline:
                            stale = self._token
                            continue
                        self._check_handshake(exc)
                        if exc.code() not in _TRANSIENT:
                            raise self._translate(exc, f"keep-alive of lease {lease_id:#x}") from exc
                        why = exc.code().name
                    else:
                        why = (f"no answer in {wait:.2f} s" if isinstance(exc, (asyncio.TimeoutError, TimeoutError))
                               else str(exc) or type(exc).__name__)
                    if backoff.spent():
                        raise StoreUnavailable(
                            f"etcd at {self.endpoint_text} did not renew lease {lease_id:#x} within "
                            f"{budget:.1f} s ({why})."
                        ) from exc
                    await backoff.wait()
                    continue
                if resp.TTL <= 0:
                    self._drop_keepalive(lease_id, forget=True)
                    raise LeaseLost(f"Lease {lease_id:#x} is gone from etcd (expired or revoked).")
                return float(resp.TTL)

    def _drop_keepalive(self, lease_id: int, *, forget: bool = False) -> None:
        if forget:
            self._keepalive_locks.pop(lease_id, None)
        call = self._keepalive_calls.pop(lease_id, None)
        if call is not None:
            call.cancel()

    async def revoke_lease(self, lease_id: int, *, timeout: float | None = None) -> None:
        self._drop_keepalive(lease_id, forget=True)
        req = rpc.LeaseRevokeRequest(ID=lease_id)
        try:
            await self._unary(f"revoke of lease {lease_id:#x}", "LeaseRevoke", "_lease_stub", req, timeout)
        except LeaseLost:
            pass

    # -- watch ----------------------------------------------------------------------------------
    async def watch_prefix(
        self, prefix: str, start_revision: int
    ) -> AsyncIterator[list[WatchEvent]]:
        raw = prefix.encode()
        next_rev = start_revision
        delay = 0.02
        stale = ""
        reauthed = False  # a cancelled creation already got a fresh token: a second one is a real refusal
        while not self._closed:
            auth = await self._metadata(time.monotonic() + self.timeout, stale)
            create = rpc.WatchCreateRequest(
                key=raw, range_end=_range_end(raw), start_revision=next_rev, progress_notify=True
            )
            requests: asyncio.Queue = asyncio.Queue()
            requests.put_nowait(rpc.WatchRequest(create_request=create))

            async def request_iter(q=requests):
                while True:
                    item = await q.get()
                    if item is None:
                        return
                    yield item

            call = self._watch_stub.Watch(request_iter(), metadata=(("hasleader", "true"), *auth))
            self._watch_calls.add(call)
            try:
                async for resp in call:
                    if resp.compact_revision:
                        raise WatchCompacted(
                            f"The watch on {prefix!r} needs revision {next_rev}, but etcd has "
                            f"compacted history up to {resp.compact_revision}.",
                            resp.compact_revision,
                        )
                    if resp.canceled and self.access.user and not reauthed and (
                            any(m in resp.cancel_reason for m in _TOKEN_EXPIRED) or _WATCH_DENIED in resp.cancel_reason):
                        stale, reauthed = self._token, True  # the token expired: authenticate again, once
                        break
                    if resp.canceled and _WATCH_DENIED in resp.cancel_reason:
                        who = f"user {self.access.user!r}" if self.access.user else "this client"
                        raise StoreError(f"etcd refused a watch on {prefix!r} to {who}: {resp.cancel_reason}. Grant "
                                         "the user's role read on the prefix /ftrt/.")
                    if resp.canceled:
                        raise StoreUnavailable(
                            f"etcd cancelled the watch on {prefix!r}: {resp.cancel_reason}"
                        )
                    if resp.created:
                        reauthed = False
                    if resp.created and next_rev == 0:
                        # "From now on" is pinned to the revision the server saw at creation, so a
                        # reconnect does not skip what happened in between.
                        next_rev = resp.header.revision + 1
                    delay = 0.02
                    if not resp.events:
                        continue
                    batch: list[WatchEvent] = []
                    for ev in resp.events:
                        put = ev.type == rpc.Event.PUT
                        batch.append(
                            WatchEvent(
                                "put" if put else "delete",
                                ev.kv.key.decode(),
                                bytes(ev.kv.value) if put else b"",
                                ev.kv.mod_revision,
                                create_revision=ev.kv.create_revision,
                                lease=ev.kv.lease,
                            )
                        )
                    next_rev = batch[-1].revision + 1
                    yield batch
                # The server ended the stream: fall through and re-watch.
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and self._closed:
                    return
                if self._token_refused(exc):
                    stale = self._token
                self._check_handshake(exc)
                log.debug("watch on %r broke (%s); re-watching from %d", prefix, exc.code().name, next_rev)
            finally:
                requests.put_nowait(None)
                call.cancel()
                self._watch_calls.discard(call)
            if self._closed:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    # -- misc -----------------------------------------------------------------------------------
    async def status(self, *, timeout: float | None = None) -> dict:
        """Return the answering member's status (version, leader, raft term), for diagnostics."""
        resp = await self._unary("status", "Status", "_maint_stub", rpc.StatusRequest(), timeout)
        return {
            "version": resp.version,
            "leader": resp.leader,
            "raft_term": resp.raftTerm,
            "db_size": resp.dbSize,
        }

    async def close(self) -> None:
        self._closed = True
        for call in list(self._watch_calls):
            call.cancel()
        for lease_id in list(self._keepalive_calls):
            self._drop_keepalive(lease_id)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


async def _renew_once(call: grpc.aio.StreamStreamCall, lease_id: int):
    """One renewal on a keep-alive stream: the request, then its answer (or ``grpc.aio.EOF``)."""
    await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
    return await call.read()
