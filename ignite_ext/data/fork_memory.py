"""Keeping the Python heap a rank shares with its forked children shared: ``gc.freeze()`` on both sides of the fork.

A forked child (a DataLoader worker, the cache's load-ahead process) shares every page of its parent's heap until
one of them writes the page. Python's cyclic collector writes to every object it examines. So the first full
collection on either side copies every page of tracked objects the two still share: 25-30 MiB with torch imported,
in the child, and as much again in the parent (a user measured 54 MiB of private memory in a rank, 9 without).

Both sides freeze, as CPython advises for processes that fork without exec. The parent: once a
:class:`~ignite_ext.data.CachedDataset` was made in a process, it collects and freezes before each of its forks (an
``os.register_at_fork`` hook). The child: a forked worker freezes what it inherited at its first read of a cache
(this covers a parent that opted out). What a process froze is never collected there: garbage cycles it made before
the fork that were still reachable then stay (the collection before the freeze frees the rest). Objects freed by
their reference count are freed as always.

.. versionadded:: 0.6.0
"""

from __future__ import annotations

import gc
import os

__all__ = ["freeze_before_forks", "share_inherited_heap"]

_armed = False  # a CachedDataset was made in this process (or in the parent it was forked from)
_wanted = True  # the user's choice, freeze_before_forks(False) to opt out
_frozen_in = 0  # the pid that froze at a first read: a worker forked from a worker freezes again


def freeze_before_forks(enabled: bool = True) -> None:
    """Whether this process collects and freezes its heap before each fork once it made a cache (on by default).

    Frozen objects stay out of this process's collector for good, so its collections no longer copy the pages its
    forked DataLoader workers map. Turn it off where the process makes many garbage cycles that are still reachable
    when it forks (they are never freed then), at the price of that copy (about the size of the process's heap).

    Args:
        enabled: False: fork without freezing, from now on in this process and in the processes it forks.

    Examples:
        >>> from ignite_ext.data.fork_memory import freeze_before_forks
        >>> freeze_before_forks(False)  # this process keeps collecting what it held at its forks
        >>> freeze_before_forks()  # the default back

    .. versionadded:: 0.6.0
    """
    global _wanted
    _wanted = enabled


def arm() -> None:
    """Freeze before this process's forks from now on (unless opted out): a cache is made in it."""
    global _armed
    _armed = True


def _before_fork() -> None:
    if _armed and _wanted:
        gc.collect()  # what is garbage now is freed, not frozen for good (once frozen, later collections are short)
        gc.freeze()


os.register_at_fork(before=_before_fork)


def share_inherited_heap() -> None:
    """Freeze the objects this process holds now, once per process (call it at a worker's first read).

    Examples:
        >>> import gc
        >>> from ignite_ext.data.fork_memory import share_inherited_heap
        >>> share_inherited_heap(); gc.get_freeze_count() > 0
        True
        >>> gc.unfreeze()  # what this example froze, back to the collector

    .. versionadded:: 0.5.0
    """
    global _frozen_in
    if _frozen_in != os.getpid():
        _frozen_in = os.getpid()
        gc.freeze()
