"""How a rank waits through the store in a block: server-side waits in slices, steps armed on the watchdog.

The block protocol (:mod:`ignite_ext.distributed._store_channel`) says what a rank waits for and who wakes it;
this module does the waiting:

* **One server-side wait per slice**, on the rank's wake key for the phase it is in (``.../wake/<rank>/<phase>``).
  Whoever completes what it waits for sets that key; its heartbeat thread sets it too (a tick of the scheduler's
  chores, :mod:`ignite_ext.distributed._chores`) when the slice is over (the log interval, with jitter), so that the
  waiter checks its timeout and logs, and at once when the process adopts a cut, which the waiter then declares in
  its block. Woken, it reads its condition: met, it returns (the key is its phase's, left for the block's
  cleanup); not met, it deletes the key and reads again before waiting again, so no wake-up is ever lost. A wait
  costs two requests when it is told (the wait and one read) and four per slice otherwise.
* **A silent store.** Each step (entry, wait, leave) is armed on the process's watchdog
  (:mod:`ignite_ext.distributed.store.watchdog`), which shuts down the connections to the store when a request is
  ``T`` overdue or ``timeout=`` is over: a request to a paused or cut-off host would otherwise block until TCP
  gives up. The step then raises ``StoreLostError``.
* **What a waiting rank shows**: a log line about once per log interval, or on a terminal the node's waiting line
  (:mod:`ignite_ext.distributed._waiting_line`), with the awaited rank's progress.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import ignite.distributed as idist

from ignite_ext.distributed._channel import log
from ignite_ext.distributed._chores import Chores
from ignite_ext.distributed._waiting_line import LOG, SHOW, WaitingLine, waiting_line_role
from ignite_ext.distributed.liveness import beat_interval, heartbeat_timeout, log_interval
from ignite_ext.distributed.store.clients import Store, StoreError, forget_client_of_this_thread, timed_out
from ignite_ext.distributed.store.keys import BlockKeys
from ignite_ext.distributed.store.watchdog import store_port, watchdog, watchdog_enabled
from ignite_ext.errors import RankFailedError, StoreLostError

__all__ = ["StoreWaiter", "guarded", "slice_seconds"]

T = TypeVar("T")

# With timeout=, how long past it a protocol step may still take before the store counts as unreachable.
_STORE_GRACE_S = 2.0


def slice_seconds() -> float:
    """How long one wait lasts before the waiter checks its timeout and logs: the log interval, with 10 % jitter.

    Many waits expiring together return late on the libuv server: the jitter spreads them.

    Examples:
        >>> from ignite_ext.distributed._store_waiting import slice_seconds
        >>> 27.0 <= slice_seconds() <= 33.0
        True

    .. versionadded:: 0.4.0
    """
    return max(0.05, log_interval()) * random.uniform(0.9, 1.1)


def guarded(fn: Callable[[], T], rank: int, label: str) -> T:
    """Run ``fn``; a store error (torch raises a ``RuntimeError``) becomes ``StoreLostError`` naming ``rank``.

    Examples:
        >>> from ignite_ext.distributed._store_waiting import guarded
        >>> def unreachable() -> None:
        ...     raise RuntimeError("Connection reset by peer")
        >>> guarded(unreachable, 1, "block 3")
        Traceback (most recent call last):
        ...
        ignite_ext.errors.StoreLostError: ...RuntimeError: Connection reset by peer...

    .. versionadded:: 0.4.0
    """
    try:
        return fn()
    except (TimeoutError, RankFailedError):
        raise
    except RuntimeError as exc:  # DistStoreError and friends: the store itself is unreachable
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise StoreLostError(
            cause,
            f"rank {rank} waiting ({label}); the store did not answer: the process hosting it (rank "
            "0's under env://, node 0's agent under torchrun) has exited, or its host is paused or unreachable",
        ) from exc


class StoreWaiter:
    """One rank's waiting in one block, on this thread's ``client`` of ``store``: see the module docstring.

    It holds nothing of the protocol (what a wait declares between slices comes with each :meth:`wait`), so that a
    block's channel and its waiter are freed as the block ends, not by the cycle collector: the channel holds the
    store, whose heartbeat beats until the store is freed.

    .. versionadded:: 0.4.0
    """

    def __init__(
        self,
        rank: int,
        label: str,
        timeout: float | None,
        store: Store,
        client: Store,
        keys: BlockKeys,
        chores: Chores,
    ) -> None:
        self.rank = rank
        self.label = label
        self.timeout = timeout
        self._store = store
        self._client = client
        self._keys = keys
        self._chores = chores
        self._started = time.monotonic()
        self._port = store_port(client)  # None: not a TCPStore, nothing to watch (see step)
        # Read once per block: a block's steps and waits would otherwise read the environment a dozen times.
        self._silence = heartbeat_timeout()
        self._watched = self._port is not None and watchdog_enabled()
        self._token: int | None = None  # the step under way, on the watchdog
        self._ends_at = float("inf")

    def bounded(self) -> float | None:
        """Seconds left of ``timeout``."""
        if self.timeout is None:
            return None
        return self.timeout - (time.monotonic() - self._started)

    def step(self, step: Callable[[], T]) -> T:
        """Run one step of the protocol; give up on a store that stops answering.

        A TCPStore client request to a paused or cut-off host blocks until TCP gives up (about 15 minutes), its
        own timeout only bounding waits for keys. So each step is armed on this process's watchdog: a request
        :func:`heartbeat_timeout` overdue (a store that silent is as lost as a rank that silent) or, with
        ``timeout=``, still unanswered when the timeout plus :data:`_STORE_GRACE_S` is over, has its connection shut
        down, and the step raises ``StoreLostError``. ``IGNITE_EXT_STORE_WATCHDOG=0`` turns the watchdog off (a
        silent store then blocks until TCP gives up).
        """
        if not self._watched or self._port is None:
            return guarded(step, self.rank, self.label)
        now = time.monotonic()
        # A step begun after the timeout (a first rank leaving after working longer) still gets the grace.
        self._ends_at = (
            float("inf") if self.timeout is None else max(now, self._started + self.timeout) + _STORE_GRACE_S
        )
        dog = watchdog()
        self._token = dog.arm(min(now + self._silence, self._ends_at), self._port)
        try:
            value = guarded(step, self.rank, self.label)
        except StoreLostError as exc:
            if not dog.disarm(self._token):
                raise
            forget_client_of_this_thread(self._store)
            raise StoreLostError(
                f"no answer for {time.monotonic() - now:.0f} s",
                f"rank {self.rank} waiting ({self.label}); the store did not answer: its host is paused or unreachable",
            ) from exc
        except BaseException:
            dog.disarm(self._token)
            raise
        if dog.disarm(self._token):  # it answered just as its connections were shut down: they are gone all the same
            forget_client_of_this_thread(self._store)
        return value

    def _expect_answer_within(self, seconds: float) -> None:
        """The request about to be sent may take ``seconds`` (a wait): move the step's deadline accordingly."""
        if self._token is not None:
            watchdog().extend(self._token, min(time.monotonic() + seconds + self._silence, self._ends_at))

    def wait(
        self,
        ready: Callable[[], T | None],
        what: str,
        phase: str,
        declare_cuts: Callable[[], bool],
        checked: bool = False,
        known: T | None = None,
        about: Callable[[], str] | None = None,
    ) -> T:
        """Block until ``ready`` returns a value; one store wait per slice; cuts declared between slices; time out.

        ``declare_cuts``: the protocol's; it declares the group's new cuts in the block (True if there were any),
        and raises if this rank is in one.
        ``phase``: the block's phase (:data:`~ignite_ext.distributed.store.keys.PHASES`), whose wake key the waker
        sets. ``checked``: the caller has just learnt what ``ready`` would return, ``known`` (no request then).
        ``about``: what the log line adds (how far the awaited rank got), asked once per line.
        """
        value = known if checked else ready()
        if value is not None:
            return value
        role = waiting_line_role(idist.get_local_rank()) if about is not None else LOG
        line = WaitingLine() if role == SHOW else None
        try:
            return self._wait_slices(ready, what, phase, declare_cuts, about, role, line)
        finally:
            if line is not None:
                line.end()

    def _wait_slices(
        self,
        ready: Callable[[], T | None],
        what: str,
        phase: str,
        declare_cuts: Callable[[], bool],
        about: Callable[[], str] | None,
        role: str,
        line: WaitingLine | None,
    ) -> T:
        """:meth:`wait`'s slices; on a terminal (``role``), ``line`` is rewritten at each one instead of logging."""
        start = logged = time.monotonic()
        wake = self._keys.wake(self.rank, phase)
        client, chores = self._client, self._chores
        while True:
            now = time.monotonic()
            left = self.bounded()
            if left is not None and left <= 0:
                raise TimeoutError(f"rank {self.rank} waited {now - start:.0f} s for {what} ({self.label})")
            if line is not None and about is not None and now - start >= 0.9 * beat_interval():
                line.show(f"rank {self.rank} has waited {now - start:.0f} s for {what}{about()}")
            elif role == LOG and now - logged >= 0.9 * log_interval():  # at a slice's end, about once an interval
                more = about() if about is not None else ""
                log().info("rank %d has waited %.0f s for %s (%s)%s", self.rank, now - start, what, self.label, more)
                logged = now
            seconds = slice_seconds() if line is None else min(slice_seconds(), max(0.05, beat_interval()))
            if left is not None:
                seconds = max(0.01, min(seconds, left))
            # The tick first, then the look at the cuts: a cut the heartbeat thread adopts after the look sets the
            # wake key (it wakes every ticked waiter), so none is missed.
            chores.tick(wake, seconds)
            if declare_cuts():
                chores.untick(wake)
                if (value := ready()) is not None:  # what this rank posted may be what it waits for
                    return value
                continue
            wait_s = seconds + max(5.0, seconds)
            self._expect_answer_within(wait_s)
            asked = time.monotonic()
            try:
                client.wait([wake], timedelta(seconds=wait_s))
            except StoreError as exc:
                if not timed_out(exc, time.monotonic() - asked, wait_s):
                    raise
                # The tick did not come (the heartbeat thread is gone): a slice all the same.
            finally:
                chores.untick(wake)
            self._expect_answer_within(0.0)
            if (value := ready()) is not None:  # told: the key stays (no later wait of the block uses it)
                return value
            # A slice's end, a cut, or a wake-up left by an earlier wait of this phase: re-arm, then look again
            # before waiting, so that a wake-up between the look above and the delete is not lost.
            client.delete_key(wake)
            if (value := ready()) is not None:
                return value

    def nap(self, seconds: float, woken: Callable[[], bool]) -> None:
        """Wait up to ``seconds`` on the turn's wake key, ended at once by a cut; no wait if ``woken()`` already."""
        wake = self._keys.wake(self.rank, "turn")
        self._chores.tick(wake, seconds)  # ended at once by a cut: the heartbeat thread wakes ticked waiters
        if not woken():
            self._expect_answer_within(seconds + 5.0)
            with contextlib.suppress(StoreError):
                self._client.wait([wake], timedelta(seconds=seconds + 5.0))
        self._chores.untick(wake)
        self._client.delete_key(wake)
