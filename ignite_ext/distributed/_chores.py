"""The scheduler's chores in a rank's heartbeat thread: wake-up ticks, deferred deletes, acknowledgements.

Liveness beats and posts cuts; what the scheduler needs done off its blocks' path rides on that thread as an
errand (:class:`~ignite_ext.distributed.liveness.heartbeat.Errand`), on the thread's own client, so that no
process runs a second thread for it:

* **ticks**: a waiting thread's wake key, set when its slice is over (so that it checks its timeout and logs), or
  at once when the process adopts a cut (so that it declares the cut's ranks in its block);
* **deferred deletes**: a block's keys, once every rank has left it, deleted at the next beat;
* **the acknowledgement** of a block's outcome by a rank other than 0, sent at the next beat or at the thread's
  end (only rank 0's process waits for it, at its exit: see :mod:`ignite_ext.distributed._lingering`), and rank
  0's hold on its last block released once the others acknowledged.

Cost: a set per tick that fires (one per slice waited, and per cut), a delete per key of a left block, one
acknowledgement per rank and block (``add``, and a set by the last). No request when there is nothing to do.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Iterable

from ignite_ext.distributed._lingering import Lingering
from ignite_ext.distributed.liveness import Heartbeat
from ignite_ext.distributed.store.clients import Store, ack, put

__all__ = ["Chores"]


class Chores:
    """The scheduler's errand in one heartbeat thread: see the module docstring. One per heartbeat (:meth:`of`).

    Examples:
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed._chores import Chores
        >>> from ignite_ext.distributed.liveness import Heartbeat
        >>> store = dist.HashStore()
        >>> heartbeat = Heartbeat(store, 0, 1, start=False)  # a simulation's: no thread
        >>> chores = Chores.of(heartbeat)
        >>> chores.ack_later("acks", "acked", 1)  # no thread runs: sent at once
        >>> bytes(store.get("acked"))
        b'1'

    .. versionadded:: 0.4.0
    """

    _by_heartbeat: weakref.WeakKeyDictionary[Heartbeat, Chores] = weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(self, heartbeat: Heartbeat) -> None:
        self._heartbeat = weakref.ref(heartbeat)  # the heartbeat holds its errands: no cycle to keep it alive
        self._lock = threading.Lock()
        self._ticks: dict[str, float] = {}  # wake key -> when to set it (monotonic)
        self._deletes: list[str] = []
        self._ack: tuple[str, str, int] | None = None
        self._ack_lock = threading.Lock()  # held while sending: cancel_ack returns once none is on its way

    @classmethod
    def of(cls, heartbeat: Heartbeat) -> Chores:
        """The chores of ``heartbeat``, made and handed to its thread on the first call."""
        with cls._guard:
            chores = cls._by_heartbeat.get(heartbeat)
            if chores is None:
                chores = cls._by_heartbeat[heartbeat] = cls(heartbeat)
                heartbeat.add_errand(chores)
            return chores

    # --- what the scheduler asks ------------------------------------------------------------------------------------

    def tick(self, key: str, seconds: float) -> None:
        """Set ``key`` in ``seconds`` (ends the caller's slice), or at once when a cut comes, unless :meth:`untick`."""
        at = time.monotonic() + seconds
        with self._lock:
            self._ticks[key] = at
        heartbeat = self._heartbeat()
        if heartbeat is not None:
            heartbeat.wake_by(at)

    def untick(self, key: str) -> None:
        """Forget the :meth:`tick` of ``key`` (its waiter is awake)."""
        with self._lock:
            self._ticks.pop(key, None)

    def delete_later(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` at the next beat (a block's keys, once every rank has left it)."""
        with self._lock:
            self._deletes.extend(keys)

    def ack_later(self, acks: str, acked: str, expected: int) -> None:
        """Acknowledge a block's outcome (:func:`~ignite_ext.distributed.store.clients.ack`) at the next beat or end.

        The latest block's replaces an earlier one's, whose hold the next block has released. Without a running
        heartbeat thread it is sent at once.
        """
        with self._ack_lock:
            self._ack = (acks, acked, expected)
        heartbeat = self._heartbeat()
        if heartbeat is not None and not heartbeat.beating():
            self._flush_ack(heartbeat.client)

    def cancel_ack(self) -> None:
        """Drop the pending acknowledgement (this rank is entering a block); wait for one being sent."""
        with self._ack_lock:
            self._ack = None

    # --- the errand: called by the heartbeat thread, on its client --------------------------------------------------

    def fire(self, client: Store) -> float:
        """Set the wake keys whose time has come; return when the next one is due (``math.inf``: none)."""
        now = time.monotonic()
        with self._lock:  # under the lock: an untick()ed key is never set afterwards
            due = [key for key, at in self._ticks.items() if at <= now]
            for key in due:
                del self._ticks[key]
                put(client, key, b"t")
            return min(self._ticks.values(), default=math.inf)

    def after_beat(self, client: Store) -> None:
        """Release rank 0's hold once acknowledged, send the acknowledgement, delete the left blocks' keys."""
        Lingering.release()
        self._flush_ack(client)
        with self._lock:
            deletes, self._deletes = self._deletes, []
        for key in deletes:
            client.delete_key(key)

    def on_cut(self, client: Store) -> None:
        """A cut was adopted: wake every ticked waiter, which declares it in its block."""
        with self._lock:
            due, self._ticks = list(self._ticks), {}
            for key in due:
                put(client, key, b"t")

    def busy(self) -> bool:
        """Whether a thread of this process waits on the store (the beats are then armed on the watchdog)."""
        with self._lock:
            return bool(self._ticks)

    def end(self, client: Store) -> None:
        """The thread is leaving (exit, group destroyed): send the acknowledgement rank 0 may wait for."""
        self._flush_ack(client)

    def _flush_ack(self, client: Store) -> None:
        with self._ack_lock:
            pending, self._ack = self._ack, None
            if pending is not None:
                ack(client, *pending)
