"""A DataLoader worker not started by fork ends with the rank that started it: it maps the cache's memory.

torch's worker compares ``os.getppid()`` with the pid it read as its loop began, which two orphans escape, holding
a SIGKILLed rank's cache for ever: a ``spawn`` worker whose rank died while it started (its loop began with init as
its parent), and every ``forkserver`` worker (its parent is the fork server, which the worker itself keeps alive).
So the dataset pickled for a worker carries the rank's identity (:func:`~ignite_ext._fs.process_identity`), and
its copy waits on a ``pidfd`` of the rank (no polling) and then ends the process if it is a DataLoader worker
(waiting up to :data:`JOINING` seconds for the worker's loop to begin). Without ``pidfd_open``, torch's watch only.

.. versionadded:: 0.5.0
"""

from __future__ import annotations

import os
import select
import threading
import time

from ignite_ext._fs import process_identity

__all__ = ["JOINING", "owner", "watch"]

#: Seconds an orphan's check waits for its DataLoader worker loop to begin (a worker still importing, under load).
JOINING = 120.0

_watched: set[str] = set()  # the owners this process watches already: one thread each


def owner() -> str | None:
    """This process's identity, for a copy of the dataset pickled for another process.

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache._orphans import owner
        >>> owner().split("|")[2] == str(os.getpid())
        True
    """
    return process_identity(os.getpid())


def watch(identity: str | None) -> None:
    """In a process unpickling the dataset: end it, if it is a DataLoader worker, once ``identity`` has exited.

    Examples:
        >>> from ignite_ext.data.cache._orphans import owner, watch
        >>> watch(owner())  # this process's own copy: nothing to watch
    """
    if identity is None or identity == owner() or identity in _watched:
        return
    _watched.add(identity)
    threading.Thread(target=_wait, args=(identity,), name="ignite_ext-rank-watch", daemon=True).start()


def _wait(identity: str) -> None:
    pid = int(identity.split("|")[2])
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = -1  # gone already
    except (OSError, AttributeError):
        return  # no pidfd here: torch's watch only
    if pidfd >= 0:
        if process_identity(pid) == identity:  # the pid is the rank's, not a later process's
            select.select([pidfd], [], [])
        os.close(pidfd)
    from torch.utils.data import get_worker_info

    deadline = time.monotonic() + JOINING
    while time.monotonic() < deadline:
        if get_worker_info() is not None:
            os._exit(1)  # nobody reads what this worker would load: its rank is gone
        time.sleep(0.1)
