"""Loading the samples that arrive next epoch ahead, in a process of their own, at a low priority.

:meth:`CachedDataset.follow(indices, ahead=...) <ignite_ext.data.CachedDataset.follow>` forks one (``os.fork``: a
daemonic process may too), niced, with one intra-op thread, until the cache is full. It dies with the thread that
started it (``PR_SET_PDEATHSIG``) and is SIGKILLed and reaped at the next ``follow``, at ``close`` and when the
dataset is collected: safe at any moment, since samples are published when complete and the space bookkeeping
survives it (:mod:`._follow`).

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence

__all__ = ["NICENESS", "LoadingAhead"]

_PR_SET_PDEATHSIG = 1
#: How much lower than its parent the loading process runs (``nice``): it takes what the workers leave.
NICENESS = 10


def _run(load: Callable[[int], bool], indices: Sequence[int], parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        return
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)  # as a DataLoader worker: the cores are the workers' and the training's
    for index in indices:
        if not load(index):
            return


def _reap(pid: int) -> None:
    """Kill ``pid`` (this process's child) unless it has exited, and wait for it."""
    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


class LoadingAhead:
    """The process that loads ``indices`` through ``load`` (one call per index, until one returns False).

    Examples:
        >>> from ignite_ext.data.cache._ahead import LoadingAhead
        >>> ahead = LoadingAhead(lambda index: True, [1, 2, 3])
        >>> ahead.join(30)
        True
        >>> ahead.stop()

    .. versionadded:: 0.4.0
    """

    def __init__(self, load: Callable[[int], bool], indices: Sequence[int]) -> None:
        self._parent = os.getpid()
        todo = list(indices)
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's frames
            code = 0
            try:
                _run(load, todo, self._parent)
            except BaseException:  # best effort: what it did not load is a miss, as without it
                code = 1
            finally:
                os._exit(code)
        self.pid = pid
        self._exit: int | None = None
        self._finalizer = weakref.finalize(self, _reap, pid)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for it to finish; whether it did (it is reaped then)."""
        deadline = time.monotonic() + timeout
        while self._exit is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done == 0:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.01)
                    continue
                self._exit = status
            if self._exit is None:
                self._exit = -1  # reaped by someone else
        # Reaped: its pid may be reused, by this process's next child even, which the finalizer must never kill.
        self._finalizer.detach()
        return True

    def stop(self) -> None:
        """Kill it if it still runs, and reap it (only in the process that started it)."""
        if os.getpid() == self._parent and self._exit is None:
            self._finalizer()
