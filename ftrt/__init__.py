"""ftrt: a fault-tolerant distributed runtime and checkpoint service for RL post-training.

Worker-side API::

    import ftrt
    rt = ftrt.init()          # rank, world size, round; works under ftrt, torchrun or alone
    rt.heartbeat(step)        # progress for hang detection and ``ftrt status``
    vote = ftrt.RoundEndVote(rt)  # each step: ``if vote():`` the round ends here (a join, a drain)

    rt.init_process_group("gloo")   # kept across rounds under ftrt launch (--recovery in-place)
    try:
        with rt.step(): ...          # ftrt.WorldChanged: a peer was lost, a node joined or drained
    except ftrt.WorldChanged:
        rt.reconfigure()             # the new round's process group, same process
        step = ftrt.sync_state(step, state_tensors)  # agree on the newest step; the behind get it
"""

from ftrt._version import __version__
from ftrt.errors import (
    CheckpointCorrupt,
    ConfigError,
    FtrtError,
    RoundChanged,
    StoreUnavailable,
    WorldChanged,
)
from ftrt.inplace import sync_state, sync_state_dict
from ftrt.runtime import Runtime, init
from ftrt.roundend import RoundEndVote

__all__ = [
    "__version__",
    "init",
    "Runtime",
    "RoundEndVote",
    "FtrtError",
    "ConfigError",
    "StoreUnavailable",
    "RoundChanged",
    "WorldChanged",
    "sync_state",
    "sync_state_dict",
    "CheckpointCorrupt",
]
