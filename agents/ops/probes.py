"""Health probes: the standard gRPC health service on the agent's port, and optional HTTP ones.

Kubernetes (and any load balancer) asks two questions, answered here from the agent's state by
one pure function, :func:`judge`:

- **live**: the agent runs and is not stopping. An agent that lost its session (etcd away longer
  than its lease: it fenced itself) is live: it rejoins by itself when etcd is back, and restarting
  every pod during an etcd outage would only make the outage worse. A probe that fails this should
  restart the pod.
- **ready** (the issue's SERVING): live, holding its session, and this node's workers run in the
  job's current round. A spare waiting to be admitted, a node whose round is being replaced, a
  fenced one or one that drains is alive but not ready; that must not restart it.

The agent's gRPC server answers ``grpc.health.v1.Health`` (``grpcio-health-checking``): service
``""`` (what a probe without ``service`` asks) is *ready*, service ``"liveness"`` is *live*. With
``ftrt launch --health-port P`` it also serves ``GET /healthz`` (live) and ``GET /readyz``
(ready) over HTTP, 200 or 503 with a one-line reason, for tools that cannot speak gRPC. The agent
calls :meth:`Probes.update` on every pass of its loop (at least every 0.5 s).
"""

from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ftrt.agents.states import AgentState
from ftrt.errors import ConfigError

LIVENESS = "liveness"
"""The gRPC health service name that answers liveness (``""`` answers readiness)."""


@dataclass(frozen=True)
class Probe:
    """The answer to both probes, and why."""

    live: bool
    """The agent runs and is not stopping (``liveness``, ``/healthz``)."""
    ready: bool
    """Live, with a session, and its workers train in the current round (``""``, ``/readyz``)."""
    detail: str
    """Why, in a few words (the HTTP body)."""


def judge(state: AgentState, *, registered: bool, expired: bool, in_round: bool, current_round: int | None) -> Probe:
    """The probes' answer for an agent in ``state`` (see the module docstring). ``in_round``: this
    node is a member of the job's current round, which is active."""
    if state.terminal:
        return Probe(False, False, f"agent {state.value}")
    if state is AgentState.FENCED or not registered or expired:
        return Probe(True, False, "fenced: its lease was lost; rejoining" if state is AgentState.FENCED
                     else "no live session with etcd")
    if state is AgentState.DRAINING:
        return Probe(True, False, "draining: leaving the job")
    if state is AgentState.RUNNING and in_round:
        return Probe(True, True, f"workers run in round {current_round}")
    if state is AgentState.FINISHED:
        return Probe(True, False, "finished; waiting for the other nodes")
    if in_round:
        return Probe(True, False, f"starting workers in round {current_round}")
    return Probe(True, False, "waiting for a round that includes this node")


class Probes:
    """The newest :class:`Probe`, served over gRPC health (``servicer``) and, if started, HTTP."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        """Add it to the agent's server: ``health_pb2_grpc.add_HealthServicer_to_server``."""
        self.probe = Probe(False, False, "starting")
        self._http: http.server.ThreadingHTTPServer | None = None

    def add_to(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def update(self, probe: Probe) -> None:
        if probe == self.probe:
            return
        self.probe = probe
        status = health_pb2.HealthCheckResponse
        await self.servicer.set("", status.SERVING if probe.ready else status.NOT_SERVING)
        await self.servicer.set(LIVENESS, status.SERVING if probe.live else status.NOT_SERVING)

    def serve_http(self, host: str, port: int) -> int:
        """Serve ``/healthz`` and ``/readyz`` on ``host:port`` in a daemon thread; the port it got."""
        probes = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the handler's name is fixed
                probe = probes.probe
                ok = {"/healthz": probe.live, "/readyz": probe.ready}.get(self.path.split("?")[0])
                if ok is None:
                    self.send_error(404, "ftrt agent: GET /healthz or /readyz")
                    return
                body = f"{'ok' if ok else 'not ok'}: {probe.detail}\n".encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        try:
            self._http = http.server.ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"--health-port {port}: cannot listen on {host}:{port} ({exc.strerror}); choose a "
                              "free port, or 0 for any.") from None
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="ftrt-health-http", daemon=True).start()
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
