"""ftrt: a fault-tolerant distributed runtime and checkpoint service for RL post-training.

Worker-side API::

    import ftrt
    rt = ftrt.init()          # rank, world size, round; works under ftrt, torchrun or alone
    rt.heartbeat(step)        # progress for hang detection and ``ftrt status``
    vote = ftrt.RoundEndVote(rt)  # each step: ``if vote():`` the round ends here (a join, a drain)
"""

from ftrt._version import __version__
from ftrt.errors import (
    CheckpointCorrupt,
    ConfigError,
    FtrtError,
    RoundChanged,
    StoreUnavailable,
)
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
    "CheckpointCorrupt",
]
