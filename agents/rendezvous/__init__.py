"""How agents agree on the job's rounds through etcd.

- :mod:`.membership`: a node's lease and registration (a new incarnation per join);
- :mod:`.jobview`: the job's rendezvous keys as one agent sees them (watched);
- :mod:`.decide`: the round decision, a pure function of (now, view, config);
- :mod:`.decider`: the elected agent that writes rounds, fenced by the election;
- :mod:`.rendezvous`: one agent's part in it (view, candidacy, decider, fenced writes).
"""
