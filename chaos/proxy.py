"""A TCP proxy (on loopback unless told otherwise) that a test or chaos scenario can cut, slow down and restore.

``tc netem`` is not available here, so network faults towards a service (S3, etcd) go through
this proxy: :meth:`TcpProxy.cut` drops every open connection and refuses new ones (an outage),
:meth:`TcpProxy.slow` delays every chunk forwarded, :meth:`TcpProxy.restore` ends both. It runs on
its own thread, so synchronous callers can use it.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time


class TcpProxy:
    """Forward ``<listen_host>:<port>`` to ``target``. Use as a context manager or start()/stop()."""

    def __init__(self, target_host: str, target_port: int, listen_port: int = 0,
                 listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.host = listen_host
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, listen_port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._peers: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._down = False
        self._hanging = False
        self._delay = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrt-tcp-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "TcpProxy":
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._thread.start()
        return self

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`restore`."""
        with self._lock:
            self._down = True
            for s in list(self._peers):
                self._close(s)

    def hang(self) -> None:
        """Accept connections and swallow what they send, answering nothing, until :meth:`restore` (a
        service that hangs: only the caller's own timeouts end its calls)."""
        self._hanging = True

    def slow(self, delay_s: float) -> None:
        """Delay every forwarded chunk by ``delay_s`` seconds."""
        self._delay = delay_s

    def restore(self) -> None:
        with self._lock:
            self._down = False
            if self._hanging:  # what was swallowed is lost: those connections cannot go on
                self._hanging = False
                for sock in list(self._peers):
                    self._close(sock)
        self._delay = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for s in list(self._peers):
                self._close(s)
        self._listener.close()

    def __enter__(self) -> "TcpProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _close(self, s: socket.socket) -> None:
        other = self._peers.pop(s, None)
        for sock in (s, other):
            if sock is None:
                continue
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            self._peers.pop(sock, None)
            try:
                sock.close()
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                sock = key.fileobj
                with self._lock:
                    if sock is self._listener:
                        self._accept()
                    elif sock in self._peers:
                        self._forward(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._down:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            client.close()  # a reset: the outage looks like a dead service
            return
        try:
            upstream = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.close()
            return
        # Blocking sockets: recv only runs when the selector says readable, and a blocking sendall
        # copes with a full send buffer (the proxy is for tests, one thread is plenty).
        for s in (client, upstream):
            s.setblocking(True)
        self._peers[client] = upstream
        self._peers[upstream] = client
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(upstream, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        if self._hanging:
            return
        if self._delay:
            time.sleep(self._delay)
        try:
            self._peers[sock].sendall(data)
        except (OSError, KeyError):
            self._close(sock)
