"""Reporting progress from a scheduled block's first ranks: what waits for them sees how far they got.

A first rank that reports progress tells every rank waiting for it (their periodic log line, and the error if it
fails or stalls) how far it got; and with a stall deadline (:func:`~ignite_ext.distributed.rank_scheduler`'s
``stall_timeout``) the ranks tell a first rank that works slowly from one that no longer advances. A report costs
no request and no system call: it writes a few numbers to this process's progress board
(:mod:`ignite_ext.progress.board`), which the rank's heartbeat thread publishes at its next beat, and only while
another rank waits for it. The package's own downloads and extractions report by themselves.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from ignite_ext.progress import board

__all__ = ["advance", "finish", "report", "track"]

T = TypeVar("T")


def report(done: float, total: float | None = None, what: str | None = None, unit: str | None = None) -> None:
    """Say how much of ``what`` is done (``done`` of ``total``); a new ``what`` starts a new activity.

    Args:
        done: how much is done so far, in ``unit``.
        total: how much there is in all, if known; ``done == total`` finishes the activity.
        what: what is being done; None keeps the current activity's.
        unit: ``"B"`` for bytes, another short word, or None to keep the current one (items by default).

    Examples:
        >>> from ignite_ext import progress
        >>> progress.report(3, total=10, what="tokenizing shards")
        >>> print(progress.current())  # doctest: +ELLIPSIS
        tokenizing shards: 3 of 10 (30 %)...

    .. versionadded:: 0.4.0
    """
    board.write(done, total, what, unit, 0.0, total is not None and done >= total)


def advance(amount: float = 1, total: float | None = None, what: str | None = None, unit: str | None = None) -> None:
    """Add ``amount`` to what is done (from threads and DataLoader workers alike: each writes its own slot).

    Examples:
        >>> from ignite_ext import progress
        >>> for _ in range(4):
        ...     progress.advance(what="filling the cache")
        >>> progress.current().done
        4.0

    .. versionadded:: 0.4.0
    """
    board.write(None, total, what, unit, float(amount), False)


def finish(what: str | None = None) -> None:
    """Say that the current activity (of this thread's process or worker) is over: no stall is counted for it.

    A stall is a report's activity that stopped advancing before it finished; work after :func:`finish` that
    reports nothing counts as not reporting (see ``stall_timeout``).

    Examples:
        >>> from ignite_ext import progress
        >>> progress.report(5, what="unpacking")
        >>> progress.finish()
        >>> progress.current().finished
        True

    .. versionadded:: 0.4.0
    """
    board.write(None, None, what, None, 0.0, True)


def track(items: Iterable[T], total: int | None = None, what: str = "items") -> Iterator[T]:
    """Yield ``items``, reporting one step per item and finishing at the end (as ``tqdm`` wraps an iterable).

    Args:
        items: what to iterate over.
        total: how many there are; ``len(items)`` where it has one.
        what: what is being done.

    Examples:
        >>> from ignite_ext import progress
        >>> [x * x for x in progress.track(range(3), what="squaring")]
        [0, 1, 4]
        >>> print(progress.current())
        squaring: 3 of 3 (100 %), finished

    .. versionadded:: 0.4.0
    """
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    board.write(0, total, what, "", 0.0, False)
    for item in items:
        yield item
        board.write(None, total, what, None, 1.0, False)
    board.write(None, total, what, None, 0.0, True)
