"""ftrt: a fault-tolerant distributed runtime and checkpoint service for RL post-training."""

from ftrt._version import __version__
from ftrt.errors import FtrtError

__all__ = ["__version__", "FtrtError"]
