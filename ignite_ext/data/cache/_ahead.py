"""Loading the samples that arrive next epoch ahead, in a process of their own, at a low priority.

:meth:`CachedDataset.follow(indices, ahead=...) <ignite_ext.data.CachedDataset.follow>` starts one: a child forked
from the calling process (a rank's main process) that loads each index of ``ahead`` the cache does not hold yet and
stores it, niced so that it takes the CPU the DataLoader workers leave, and dies with its parent
(``PR_SET_PDEATHSIG``). It is killed at the next ``follow`` and at ``close``: a SIGKILL is safe at any moment, since
a sample is published only when complete (:mod:`~ignite_ext.data.cache.arena`).

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

__all__ = ["LoadingAhead"]

_PR_SET_PDEATHSIG = 1
#: How much lower than its parent the loading process runs (``nice``): it takes what the workers leave.
NICENESS = 10


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


def _run(load: Callable[[int], None], indices: Sequence[int], parent: int) -> None:
    _die_with_parent(parent)
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    for index in indices:
        load(index)


class LoadingAhead:
    """The process that loads ``indices`` through ``load`` (one call per index), started at once.

    Examples:
        >>> from ignite_ext.data.cache._ahead import LoadingAhead
        >>> ahead = LoadingAhead(lambda index: None, [1, 2, 3])
        >>> ahead.join(30)
        True
        >>> ahead.stop()

    .. versionadded:: 0.4.0
    """

    def __init__(self, load: Callable[[int], None], indices: Sequence[int]) -> None:
        self._pid = os.getpid()
        self._process: BaseProcess = mp.get_context("fork").Process(
            target=_run, args=(load, list(indices), self._pid), name="ignite_ext-load-ahead", daemon=True
        )
        self._process.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for it to finish; whether it did."""
        self._process.join(timeout)
        return self._process.exitcode is not None

    def stop(self) -> None:
        """Kill it if it still runs, and reap it (only in the process that started it)."""
        if os.getpid() != self._pid:
            return
        if self._process.exitcode is None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self._process.kill()
        with contextlib.suppress(ValueError, AssertionError):
            self._process.join(10)
