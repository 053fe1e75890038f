"""The policy: what a sample is. The model, the tasks with their verifiable rewards, seeded sampling,
and the policy spec a trainer publishes, shared by the built-in GRPO trainer (:mod:`ftrt.grpo`) and
the rollout servers (:mod:`ftrt.rollout`), neither of which the other needs to import for it.
"""
