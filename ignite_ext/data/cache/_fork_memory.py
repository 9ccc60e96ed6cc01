"""Keeping a forked DataLoader worker's inherited memory shared with its parent and siblings.

Python's collector writes to every object it examines: a worker's first full collection copies every page of
tracked objects it inherited (25-30 MiB with torch imported, per process). ``gc.freeze()`` at a worker's first read
keeps them out of the collector's reach (CPython's advice for servers that fork); the garbage cycles the rank held
at the fork then stay, shared, in the worker's memory.

.. versionadded:: 0.5.0
"""

from __future__ import annotations

import gc
import os

__all__ = ["share_inherited_heap"]

_frozen_in = 0  # the pid that froze: a worker forked from a worker freezes again


def share_inherited_heap() -> None:
    """Freeze the objects this process holds now, once per process (call it at a worker's first read).

    Examples:
        >>> import gc
        >>> from ignite_ext.data.cache._fork_memory import share_inherited_heap
        >>> share_inherited_heap(); gc.get_freeze_count() > 0
        True
        >>> gc.unfreeze()  # what this example froze, back to the collector
    """
    global _frozen_in
    if _frozen_in != os.getpid():
        _frozen_in = os.getpid()
        gc.freeze()
