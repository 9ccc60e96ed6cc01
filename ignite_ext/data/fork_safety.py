"""Forking a rank on an interpreter with CPython's fork deadlock (gh-112275): which ones, and the warning.

CPython 3.9.0-3.9.19, 3.10.0-3.10.14 and 3.11.0-3.11.9 can leave a forked child waiting for ever, before it runs a
line of Python: the child waits for the interpreter's thread-state lock, which another thread of the parent held at
the instant of the fork while creating or deleting its Python thread state. Threads that are not Python's do that
all the time in a training rank: gloo's and NCCL's threads call into Python when they drop the last reference to a
tensor a collective used. So every DataLoader worker a rank forks after collectives, and the cache's load-ahead
process, can hang there. Fixed in 3.9.20, 3.10.15 and 3.11.10 (September 2024); 3.12.0 and later are free of it.

The way out: a fixed interpreter, or workers that are not forked from the rank
(``DataLoader(..., multiprocessing_context="forkserver")``: the fork server is a fresh, single-threaded process).
On such an interpreter, a rank that uses a :class:`~ignite_ext.data.CachedDataset` or a
:class:`~ignite_ext.data.ShardedDistributedSampler` with a process group up warns when it forks: a DataLoader worker
or the cache's load-ahead process (:class:`ForkDeadlockWarning`). It warns once per node, on its local rank 0, and
only where a fork happens. Workers started by ``spawn`` or ``forkserver`` get no warning: a rank started by
``idist.Parallel`` spawns its workers by default.

.. versionadded:: 0.5.0
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType

from ignite_ext.errors import IgniteExtError

__all__ = ["FIXED_IN", "ForkDeadlockWarning", "fork_deadlock_possible", "warn_if_forks_can_hang"]

#: For each minor version that has the deadlock, the first release without it.
FIXED_IN: dict[tuple[int, int], tuple[int, int, int]] = {(3, 9): (3, 9, 20), (3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}

_warned = threading.Event()
_armed: list[str] = []  # what the rank uses that forks (the first name told), once a warning may be due


class ForkDeadlockWarning(IgniteExtError, UserWarning):
    """A rank on an interpreter with CPython's fork deadlock (gh-112275) is about to fork: a child may never start.

    A :class:`UserWarning` and an :class:`~ignite_ext.errors.IgniteExtError`. Use a fixed interpreter (3.11.10 or
    later, 3.12, 3.13) or ``DataLoader(..., multiprocessing_context="forkserver")``; silence it with
    ``warnings.filterwarnings("ignore", category=ForkDeadlockWarning)``.

    Examples:
        >>> from ignite_ext.data.fork_safety import ForkDeadlockWarning
        >>> issubclass(ForkDeadlockWarning, UserWarning)
        True

    .. versionadded:: 0.5.0
    """


def fork_deadlock_possible(version: tuple[int, ...] | None = None, implementation: str | None = None) -> bool:
    """Whether this interpreter (or ``version`` of ``implementation``) has gh-112275.

    Examples:
        >>> from ignite_ext.data.fork_safety import fork_deadlock_possible
        >>> fork_deadlock_possible((3, 11, 7)), fork_deadlock_possible((3, 11, 10)), fork_deadlock_possible((3, 12, 0))
        (True, False, False)

    .. versionadded:: 0.5.0
    """
    version = tuple(sys.version_info[:3]) if version is None else tuple(version)
    implementation = sys.implementation.name if implementation is None else implementation
    fixed = FIXED_IN.get((version[0], version[1]))
    return implementation == "cpython" and fixed is not None and version < fixed


def _group_up() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def warn_if_forks_can_hang(what: str) -> bool:
    """Warn once per process when this rank, which uses ``what``, forks; whether a warning is now due at a fork.

    A warning is due where the interpreter has the deadlock, a process group is up (its threads are what call into
    Python), this is its node's local rank 0 (one line per node, not per rank) and it has not warned yet. It comes
    at the rank's next ``os.fork``: a DataLoader worker started by ``fork`` (the loader's
    ``multiprocessing_context``, or the process's default start method), or the cache's load-ahead process. Workers
    started by ``spawn`` or ``forkserver`` are not forked from the rank and get none.

    Examples:
        >>> from ignite_ext.data.fork_safety import warn_if_forks_can_hang
        >>> warn_if_forks_can_hang("a test")  # no process group here
        False

    .. versionadded:: 0.5.0
    .. versionchanged:: 0.6.0
       Warns at the fork itself, not when ``what`` is made: no warning where workers are spawned.
    """
    if _warned.is_set() or not fork_deadlock_possible() or not _group_up():
        return False
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    if not _armed:
        _armed.append(what)
    return True


def _warn_before_fork() -> None:
    """Just before this process forks: the warning, if one is due (see :func:`warn_if_forks_can_hang`)."""
    if not _armed or _warned.is_set() or not _group_up():
        return
    _warned.set()
    version = ".".join(map(str, sys.version_info[:3]))
    fixed = ".".join(map(str, FIXED_IN.get(sys.version_info[:2], FIXED_IN[3, 11])))
    warnings.warn(
        f"This rank uses a {_armed[0]} and forks a process (a DataLoader worker, or the cache's load-ahead process) "
        f"on Python {version} with a process group up. The child can hang before it starts: CPython's fork deadlock "
        f"(gh-112275). The rank then waits for it for ever. Use Python {fixed} or later (3.12, 3.13), or "
        f'DataLoader(..., multiprocessing_context="forkserver")',
        ForkDeadlockWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside multiprocessing, torch, ignite and this package: the user's."""
    # The caller of _warn_before_fork (the code that called os.fork): its own frame is level 1 for warn().
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and any(part in frame.f_code.co_filename for part in _NOT_USERS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


_NOT_USERS = tuple(f"{os.sep}{name}{os.sep}" for name in ("multiprocessing", "torch", "ignite", "ignite_ext"))

# Only where it can matter: every other interpreter's forks stay free of the hook.
if fork_deadlock_possible() and hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_warn_before_fork)
