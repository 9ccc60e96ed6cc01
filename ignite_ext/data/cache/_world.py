"""Whether this process is one rank of several, asked of :mod:`ignite.distributed` only where it can be.

Importing :mod:`ignite.distributed` costs a process about 60 MB and 85 000 Python objects, which every DataLoader
worker it forks partly copies again as it touches them. A process alone needs none of it, and is known to be alone
without ignite: ignite sees several ranks only through a process group, Horovod or torch_xla, none of which exists
unless imported or initialised. Where ignite is loaded already, it is asked.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["ignite_world"]

# Loaded by whoever sets up a distributed context that ignite.distributed would find, other than a process group.
_CONTEXTS = ("ignite.distributed", "horovod.torch", "torch_xla")


def ignite_world() -> ModuleType | None:
    """:mod:`ignite.distributed` where this process may be one rank of several; None where it is surely alone.

    Alone: no process group initialised, and neither ignite's distributed module, Horovod nor torch_xla loaded.

    Examples:
        >>> from ignite_ext.data.cache._world import ignite_world
        >>> world = ignite_world()
        >>> world is None or world.get_world_size() == 1  # no process group here; ignite may be loaded already
        True

    .. versionadded:: 0.2.0
    """
    dist = sys.modules.get("torch.distributed")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    if not grouped and not any(name in sys.modules for name in _CONTEXTS):
        return None
    import ignite.distributed as idist

    return idist
