"""Whether a process of this host is still alive: what the download and cache cleanups decide on."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Return whether ``pid`` runs on this host; a zombie (killed, not yet reaped) counts as dead.

    Examples:
        >>> import os
        >>> from ignite_ext.data._proc import pid_alive
        >>> pid_alive(os.getpid())
        True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:  # a killed child that its parent has not reaped yet is a zombie: it will never write again
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
