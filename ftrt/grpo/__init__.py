"""Built-in GRPO trainer and rollout loop, run under ftrt (``python -m ftrt.grpo``).

Public pieces: :class:`GRPOConfig` / :func:`load_config` (configuration), :func:`train` (the
loop), :func:`register_task` and :class:`Task` (add your own verifiable task), and the pure loss
functions in :mod:`ftrt.grpo.loss`.
"""

from ftrt.grpo.config import GRPOConfig, load_config
from ftrt.policy.tasks import Task, register_task

__all__ = ["GRPOConfig", "Task", "load_config", "register_task", "train"]


def train(cfg: GRPOConfig):
    """Run (or resume) a GRPO job; see :func:`ftrt.grpo.trainer.train`."""
    from ftrt.grpo.trainer import train as _train

    return _train(cfg)
