"""What agents do for one another, over gRPC.

- :mod:`.service`: each agent's ``AgentService`` (health, status, liveness, replicas);
- :mod:`.monitor`: liveness streams to ring successors, a dead peer's lease revoked at once;
- :mod:`.replicator`: memory checkpoints copied to ring successors;
- :mod:`.tls`: the agents' own TLS, and one channel per peer kept across rounds.
"""
