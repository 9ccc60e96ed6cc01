"""A cache's files deleted on ``SIGTERM`` as at a normal exit: what launchers send the other ranks when one fails.

Python's default ``SIGTERM`` runs neither ``atexit`` nor finalizers. The first arena a process creates installs
:func:`_on_sigterm` (in the main thread of a process that is not a DataLoader worker, never over an ignored
``SIGTERM`` nor a handler set outside Python): over the default action it deletes the process's arenas and
delivers the signal again with the default action; over the program's handler it runs that handler, and the
arenas go when the process exits as it decides. Forked children get the handler before it back. The cache guide's
*Cleanup* says when it runs, and when an elastic worker keeps its files for a restart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import Any

__all__ = ["install", "register", "replaced", "terminating"]

_Handler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None

#: The process that installed the handler (a forked child inherits it, not the arenas to delete).
_owner = 0
#: The handler that was there before ours, to chain to.
_previous: _Handler = signal.SIG_DFL
#: Whether this process has received SIGTERM (then a live agent's arenas are kept at exit).
_signalled = False
#: The finalizers of the arenas this process created and deletes at exit (a finalizer is dead once it has run).
_finalizers: list[weakref.finalize[Any, Any]] = []


def terminating() -> bool:
    """Whether this process has received ``SIGTERM`` through the cache's handler."""
    return _signalled and _owner == os.getpid()


def replaced() -> bool:
    """Whether the program put a ``SIGTERM`` handler of its own over the cache's, in this process."""
    current = signal.getsignal(signal.SIGTERM)
    return _owner == os.getpid() and current is not _on_sigterm and callable(current)


def register(finalizer: weakref.finalize[Any, Any]) -> None:
    """Run ``finalizer`` (an arena's deletion at exit) when this process is SIGTERMed, and install the handler."""
    _finalizers[:] = [f for f in _finalizers if f.alive]
    _finalizers.append(finalizer)
    install()


def _in_dataloader_worker() -> bool:
    data = sys.modules.get("torch.utils.data")  # never imported here: a process without torch has no workers
    return data is not None and data.get_worker_info() is not None


def install() -> None:
    """Install the cache's ``SIGTERM`` handler in this process, where allowed (see the module docstring); idempotent."""
    global _owner, _previous
    if _owner == os.getpid():
        return
    if threading.current_thread() is not threading.main_thread() or _in_dataloader_worker():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:  # forked from a process that had it, keeping _previous: this process's own now
        _owner = os.getpid()
        return
    if current is None or current == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _previous, _owner = current, os.getpid()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _signalled
    mine = _owner == os.getpid()
    if mine:
        _signalled = True
    if callable(_previous):
        _previous(signum, frame)  # the program's own shutdown; the finalizers run at its exit
        return
    if mine:
        for finalizer in list(_finalizers):
            finalizer()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _restore_in_child() -> None:
    """After a fork: the child (a DataLoader worker, most often) gets the handler that was there before ours."""
    if _owner and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        with contextlib.suppress(ValueError):  # not the main thread: Python forbids it (never seen after a fork)
            signal.signal(signal.SIGTERM, _previous)


os.register_at_fork(after_in_child=_restore_in_child)
