"""Rank 0's last block, whose readers may still be using the store that rank 0's process hosts.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from datetime import timedelta

from ignite_ext.distributed.liveness.settings import heartbeat_timeout
from ignite_ext.distributed.store.clients import Store, check, origin
from ignite_ext.distributed.store.keys import BlockKeys

__all__ = ["Lingering"]


class Lingering:
    """Rank 0's last block, whose readers may still be using the store that rank 0's process hosts.

    Under ``env://`` launches the store lives in rank 0's process: if rank 0 ended its process right after
    a block, the others could lose the store while reading the outcome. Rather than make every block wait,
    rank 0 keeps the store alive and, at interpreter exit, waits (bounded, on one key) until the others
    acknowledged. The next block needs nothing: its entry proves everyone finished the previous one. So the others
    acknowledge off the blocks' path, at their heartbeat's next beat (``T/6``) or their own exit, whichever comes
    first (:meth:`~ignite_ext.distributed._chores.Chores.ack_later`), and only their latest block. A rank declared
    dead never acknowledges: rank 0 waits for the others only (it waited ``T`` for the dead).
    """

    pending: tuple[Store, BlockKeys, int, Callable[[], set[int]]] | None = None
    # torch's store behind ``pending``'s: holding it is what keeps the server alive where this process hosts it.
    held: Store | None = None
    registered = False

    @classmethod
    def hold(cls, store: Store, keys: BlockKeys, expected: int, dead: Callable[[], set[int]]) -> None:
        """Keep ``store`` until ``expected`` ranks, less those ``dead()`` names, acknowledged ``keys``' block."""
        cls.pending, cls.held = (store, keys, expected, dead), origin(store)
        if not cls.registered:
            atexit.register(cls.drain)
            cls.registered = True

    @classmethod
    def release(cls, store: Store | None = None) -> None:
        """Drop the hold once the readers acknowledged (or, with ``store``, when a new block on it starts).

        Holding the store longer than needed would keep its port bound after ``destroy_process_group``.
        """
        pending = cls.pending
        if pending is None:
            return
        held, keys, _, _ = pending
        try:
            if held is store or check(held, [keys.acked]):
                cls.pending = cls.held = None
        except Exception:
            cls.pending = cls.held = None  # the store is gone: nothing left to protect

    @classmethod
    def drain(cls) -> None:
        pending, cls.pending = cls.pending, None
        if pending is None:
            return
        store, keys, expected, dead = pending
        deadline = time.monotonic() + heartbeat_timeout()
        try:
            if not dead() - {0}:  # everyone may acknowledge: one wait on the server, which sets the key at the count
                store.wait([keys.acked], timedelta(seconds=heartbeat_timeout()))
                return
            # A rank declared dead never acknowledges, so the key is never set: rank 0 looks at the count itself,
            # on its own store, at its exit only, at most T / _LOOK times.
            while time.monotonic() < deadline and not check(store, [keys.acked]):
                if int(store.add(keys.acks, 0)) >= expected - len(dead() - {0}):
                    return  # every rank that lives has acknowledged
                time.sleep(_LOOK)
        except Exception:
            return  # the others are gone already, and the store with them
        finally:
            cls.held = None


#: Seconds between two looks at the acknowledgements at exit (a few requests to this process's own store).
_LOOK = 0.05
