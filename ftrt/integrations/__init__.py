"""ftrt inside the trainers people already use (docs/integrations.md).

Each module imports its trainer library when it is imported, never before: ``import ftrt`` needs
none of them.

- ``ftrt.integrations.hf``: the Hugging Face ``Trainer`` (and what builds on it), plus
  ``ElasticTrainer`` for node loss without skipped or repeated samples;
- ``ftrt.integrations.trl``: TRL's ``GRPOTrainer`` (its generation buffer, its data in generations);
- ``ftrt.integrations.lightning``: PyTorch Lightning (checkpoint IO, callback);
- ``ftrt.integrations.commits``: the trainer-agnostic commit and resume of checkpoint folders;
- ``ftrt.integrations.ray``: an elastic worker group for single-controller Ray programs (docs/ray.md).
"""
