"""ftrt's checkpoint service: sharded async checkpoints with atomic, checksummed commits.

::

    from ftrt.checkpoint import Checkpointer
    ck = Checkpointer(url, keep=3)        # path, file://, s3://bucket/prefix, memory://name
    h = ck.save(step, state)              # returns at once
    h.wait_staged()                       # before optimizer.step(): the state was copied
    h.wait()                              # committed, or raises CheckpointSaveFailed
    step = ck.restore(state)              # newest verified checkpoint, in place; None if none
    ck.close()
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftrt.checkpoint.checkpointer import Checkpointer, SaveHandle

__all__ = ["Checkpointer", "SaveHandle"]


def __getattr__(name: str):
    # Lazy: the agent imports torch-free parts of this package (memfiles) and must not pay for
    # importing torch.
    if name in __all__:
        from ftrt.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)
