"""Keeping a forked DataLoader worker's inherited memory shared with its parent and siblings.

A worker forked from a rank shares every page of the rank's Python heap with it and with the other workers until
one of them writes the page. Python's cyclic garbage collector writes to every object it examines: the first full
collection in a worker (which a worker that allocates containers per sample reaches within an epoch) gives that
worker a private copy of every page holding a tracked object it inherited, and leaves the rank's own copy private
too: tens of MiB per process (a rank with torch imported holds 25-30 MiB of such objects), the same whatever the
samples. ``gc.freeze()`` in the worker moves what it inherited out of the collector's reach, so later collections
examine only the worker's own objects (the measure CPython's ``gc`` documentation gives for servers that fork).

What is frozen is never collected in that worker: garbage cycles the rank held at the fork stay in the worker's
memory, shared with the rank's, as they would without the freeze until a collection found them.

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
