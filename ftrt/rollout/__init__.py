"""The rollout fleet: rollout servers as processes of their own, and the trainer's side of them.

``ftrt rollout serve`` (:mod:`.server`) runs one server of a job: it registers under a lease in
etcd, builds the job's policy from the spec the trainer publishes (:mod:`.spec`), takes weight
pushes (:mod:`.weights`) and samples prompt groups (:mod:`.engine`). The trainer's rank 0 keeps
the dispatch ledger (:mod:`.ledger`) and talks to the servers (:mod:`.fleet`). docs/rollout.md
explains the protocol and its guarantees.
"""
