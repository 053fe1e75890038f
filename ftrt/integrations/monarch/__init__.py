"""ftrt for single-controller Monarch programs (``torchmonarch``): the elastic worker group with its
node hosts on Monarch process meshes (docs/ray.md, "Monarch").

Monarch is imported only when a group is made: ``import ftrt`` never needs it.
"""

from ftrt.integrations.hostgroup import CallResult, GroupError
from ftrt.integrations.monarch.group import MonarchGroup

__all__ = ["CallResult", "GroupError", "MonarchGroup"]
