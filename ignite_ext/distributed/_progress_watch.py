"""A first rank's progress, published for the ranks that wait for it, and its stall, declared for them.

While a rank runs a block's body that other ranks wait for, its heartbeat thread (:meth:`Heartbeat.follow
<ignite_ext.distributed.liveness.Heartbeat.follow>`) reads the rank's progress board (:mod:`ignite_ext.progress`)
after each beat:

* **Publish.** When the progress changed since the last beat, one ``set`` of the block's ``progress/<rank>`` key:
  at most one request per beat per rank that reports, none while nothing changes. At 10,000 ranks with one rank
  first (or one per node of 8) reporting, that is one (or 1,250) requests per beat in the job, whatever the
  number of waiting ranks; each waiting rank reads the key once per log line (30 s).
* **Stall.** With a stall deadline ``S``, a reported activity that has not finished and has not advanced for
  ``S`` is a stall: the heartbeat thread posts the rank's outcome as :class:`~ignite_ext.errors.RankStalledError`
  (the same ``compare_set`` as any outcome: exactly one outcome per rank), counts its exit and wakes the ranks
  that wait for it, which raise the error in this block. The main thread, wedged, is left alone; if it ever
  leaves the block, it raises the error too. A rank whose process is stopped (SIGSTOP) does not beat, so this
  never runs for it: its silence makes it dead, as before. A GIL held for ever by a C call stops this thread
  too, while the keeper beats for the rank: that wedge is the wall-clock ``timeout=``'s.

Asked for explicitly (``stall_timeout=S``), the deadline also counts while nothing is reported: from the body's
start, or from the last report of a finished activity.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ignite_ext import progress
from ignite_ext.distributed.store.clients import Store, put
from ignite_ext.distributed.store.codecs import encode_progress
from ignite_ext.errors import RankFailure, RankStalledError

if TYPE_CHECKING:
    from ignite_ext.distributed._store_channel import StoreChannel

__all__ = ["ProgressWatch", "stall_message", "watched"]


def stall_message(stalled_for: float, deadline: float, last: progress.Progress | None) -> str:
    """What a stall's failure says: how long, the deadline, and the last progress the rank reported.

    Examples:
        >>> from ignite_ext.distributed._progress_watch import stall_message
        >>> from ignite_ext.progress import Progress
        >>> stall_message(601.2, 600, Progress("downloading a.bin", 4.6e7, 1.024e8, None, 601.2, False, "B"))
        'made no progress for 601 s (stall_timeout=600 s); last: downloading a.bin: 46.0 of 102.4 MB (45 %)'
        >>> stall_message(31.0, 30, None)
        'made no progress for 31 s (stall_timeout=30 s); it reported none in this block'
    """
    head = f"made no progress for {stalled_for:.0f} s (stall_timeout={deadline:g} s)"
    return f"{head}; last: {last}" if last is not None else f"{head}; it reported none in this block"


class ProgressWatch:
    """The heartbeat thread's follower for one rank's body in one block (see the module docstring)."""

    def __init__(self, channel: StoreChannel, stall_timeout: float | None, from_start: bool) -> None:
        self.channel = channel
        self.stall_timeout = stall_timeout
        self.from_start = from_start
        self.started = time.monotonic()
        self.stalled: RankFailure | None = None  # set once, by the heartbeat thread, when it declared the stall
        self.closed = False  # the body is over: a call still under way posts nothing more
        self._published: tuple[str, float, bool] | None = None
        self._lock = threading.Lock()

    def __call__(self, client: Store) -> None:
        with self._lock:
            if self.stalled is not None or self.closed:
                return
            now = progress.current()
            if now is not None:
                state = (now.what, now.done, now.finished)
                if state != self._published:
                    record = (now.what, now.done, now.total, now.rate, now.since, now.finished, now.unit)
                    key = self.channel.keys.progress(self.channel.rank)
                    if self._published is None:  # deleted with the block's keys, as its failure records are
                        self.channel.state.carried.setdefault(self.channel.seq, []).append(key)
                    put(client, key, encode_progress(record))
                    self._published = state
            silent = self._silent_for(now)
            stalled = self.stall_timeout is not None and silent is not None and silent > self.stall_timeout
            if stalled and not self.closed:
                assert silent is not None and self.stall_timeout is not None
                failure = RankFailure(
                    self.channel.rank, RankStalledError.__name__, stall_message(silent, self.stall_timeout, now)
                )
                if self.channel.post_stall(client, failure):
                    self.stalled = failure

    def _silent_for(self, now: progress.Progress | None) -> float | None:
        """Seconds the rank has not advanced, as the deadline counts them; None when it does not count."""
        if now is not None and not now.finished:
            return now.since
        if not self.from_start:
            return None
        since_start = time.monotonic() - self.started
        return since_start if now is None else min(since_start, now.since)


@contextmanager
def watched(channel: StoreChannel, stall_timeout: float | None, from_start: bool) -> Iterator[ProgressWatch]:
    """Follow this rank's progress while its body runs (its board begun); yield the watch.

    Every rank's body is waited for: by the ranks whose turn comes after it, and by every rank at the block's
    exit (a block is all-or-nothing). So a later rank that stalls is posted as one too, and the others, waiting
    at the exit, raise it in the same block.
    """
    watch = ProgressWatch(channel, stall_timeout, from_start)
    channel.heartbeat.follow(watch)
    try:
        yield watch
    finally:
        watch.closed = True
        channel.heartbeat.unfollow(watch)
