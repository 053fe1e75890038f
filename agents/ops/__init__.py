"""What operators see and do: metrics, events, probes, ``ftrt status``, ``ftrt drain``, preemption
notices, and simulated nodes for rendezvous benchmarks.

- :mod:`.metrics`, :mod:`.telemetry`: Prometheus metrics (and the no-op without ``--metrics-port``);
- :mod:`.events`: the event log (etcd and a JSON-lines file);
- :mod:`.probes`: gRPC and HTTP health probes, judged by one pure function;
- :mod:`.status`: ``ftrt status``;
- :mod:`.drain`: ``ftrt drain`` (asks a node to leave through etcd);
- :mod:`.preemption`: a cloud's preemption notice (a URL or a file) starts a drain;
- :mod:`.sim`: many simulated nodes in one process (the agent's real rendezvous code).
"""
