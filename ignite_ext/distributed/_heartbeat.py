"""Liveness for the store channel: heartbeats on their own client, watches of a peer, and rank 0's last block.

See :mod:`ignite_ext.distributed._store_channel` for how they are used.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import atexit
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta

from ignite_ext.distributed._channel import heartbeat_timeout, log_interval
from ignite_ext.distributed._steps import store_port, watchdog, watchdog_enabled
from ignite_ext.distributed._store import BlockKeys, Store, default_store, heartbeat_key, put, read

__all__ = [
    "Heartbeat",
    "Lingering",
    "Watch",
    "beat_count",
    "client_of_this_thread",
    "clone",
    "forget_client_of_this_thread",
    "slice_seconds",
    "stopped_with",
    "watch_for_groups",
]


def slice_seconds(heartbeat_watches: bool = True) -> float:
    """How long one wait lasts before the waiter checks its timeout and logs (with 10 % jitter).

    A slice is the log interval while this rank's heartbeat thread watches the successor the waiter watches (it
    wakes the waiter early when that successor falls silent), and at most a third of the heartbeat timeout when the
    waiter itself must read a successor's beats (one read per slice, after ranks died in the block).

    Args:
        heartbeat_watches: whether the heartbeat thread watches the waiter's successor.

    Examples:
        >>> import os
        >>> from ignite_ext.distributed._heartbeat import slice_seconds
        >>> os.environ["IGNITE_EXT_HEARTBEAT_TIMEOUT"] = "30"
        >>> 27.0 <= slice_seconds() <= 33.0, 9.0 <= slice_seconds(heartbeat_watches=False) <= 11.0
        (True, True)
        >>> del os.environ["IGNITE_EXT_HEARTBEAT_TIMEOUT"]
    """
    seconds = log_interval() if heartbeat_watches else min(log_interval(), heartbeat_timeout() / 3)
    # Many waits expiring together return late on the libuv server: spread them.
    return max(0.05, seconds) * random.uniform(0.9, 1.1)


def clone(store: Store) -> Store:
    try:
        return store.clone()  # type: ignore[attr-defined,no-any-return]
    except (AttributeError, RuntimeError):  # a store that cannot be cloned (HashStore): share it
        return store


def beat_count(beat: bytes | None) -> bytes | None:
    return None if beat is None else beat.split(b"|", 1)[0]


def stopped_with(beat: bytes, dead: bytes) -> bool:
    """Whether ``beat`` (of the dead rank's successor) is at most two beats past what the dead rank last saw of it."""
    try:
        count, seen = int(beat.split(b"|", 1)[0]), int(dead.split(b"|", 1)[1])
    except (IndexError, ValueError):
        return False  # the dead rank had not seen it beat yet
    return count <= seen + 2


class Heartbeat:
    """One daemon thread per process and store, on its own client: beats, watches the ring successor, wakes waiters.

    Each beat reads the successor's beat (it is part of this rank's own, see ``stopped_with``), so the thread keeps
    the one view of the successor every waiter of this process uses (:meth:`view_of`): waiting costs no reads of
    it. When the successor has been silent for the heartbeat timeout, the thread ends every waiter's slice at once,
    so that they declare it dead. While a waiter waits, each beat is armed on the watchdog: a store that does not
    answer a beat within the heartbeat timeout is lost for the waiters too, whose slices are long.
    """

    _instances: weakref.WeakKeyDictionary[Store, Heartbeat] = weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(self, store: Store, rank: int, world_size: int) -> None:
        self._store = weakref.ref(store)
        self._client = clone(store)
        self._rank, self._successor = rank, (rank + 1) % world_size
        self._count = 0
        self._every = max(0.05, heartbeat_timeout() / 6)
        self._port = store_port(self._client)
        self._pending: list[str] = []
        self._ticks: dict[str, float] = {}  # wake key -> when to set it
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watch = Watch(self._successor)  # the successor's beats, as this thread reads them
        # The start of the successor's current silence, and the wake keys already set for it.
        self._alarmed: tuple[float, set[str]] = (float("nan"), set())
        self._beat()
        threading.Thread(target=self._run, name="ignite_ext-heartbeat", daemon=True).start()

    @classmethod
    def ensure(cls, store: Store, rank: int, world_size: int) -> Heartbeat:
        with cls._guard:
            hb = cls._instances.get(store)
            if hb is None:
                hb = cls._instances[store] = cls(store, rank, world_size)
            return hb

    def delete_later(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._pending.extend(keys)

    def tick(self, key: str, seconds: float) -> None:
        """Set ``key`` in ``seconds`` (ends the caller's slice), unless :meth:`untick` comes first."""
        with self._lock:
            self._ticks[key] = time.monotonic() + seconds
        self._wake.set()

    def untick(self, key: str) -> None:
        with self._lock:
            self._ticks.pop(key, None)

    def view_of(self, rank: int) -> tuple[bytes | None, float] | None:
        """``rank``'s last beat and how long it had been unchanged when this thread last read it.

        None when this thread does not watch ``rank`` (it is not the ring successor), or when its last read is
        more than two beats old (the thread is stuck or gone): the caller then reads the beat itself.
        """
        with self._lock:
            watch = self._watch
            if watch.rank != rank or time.monotonic() - watch.read_at > 2 * self._every:
                return None
            return watch.value, watch.read_at - watch.since

    def watch_of(self, rank: int) -> Watch:
        """A watch of ``rank`` for a caller that reads its beats itself.

        A copy of this thread's when it watches ``rank``, so that the silence it measured goes on counting (its
        reads may lag on a loaded host), else a new one.
        """
        watch = Watch(rank)
        with self._lock:
            if self._watch.rank == rank:
                watch.value, watch.since, watch.read_at = self._watch.value, self._watch.since, self._watch.read_at
        return watch

    def _beat(self) -> bool:
        if self._store() is None:
            return False
        client = self._client
        self._count += 1
        successor = read(client, heartbeat_key(self._successor))
        now = time.monotonic()
        with self._lock:
            silent = self._watch.observe(successor, now)
            self._watch.read_at = now
        put(client, heartbeat_key(self._rank), b"%d|%s" % (self._count, beat_count(successor) or b"-"))
        if successor is not None and silent > heartbeat_timeout():
            self._alarm()
        Lingering.release()
        with self._lock:
            pending, self._pending = self._pending, []
        for key in pending:
            client.delete_key(key)
        return True

    def _alarm(self) -> None:
        """Wake each waiter once per silence of the successor (also one that began its slice after the silence did).

        Once woken, a waiter declares the successor dead and watches the ranks after it itself.
        """
        with self._lock:
            since, woken = self._alarmed
            if since != self._watch.since:
                since, woken = self._alarmed = (self._watch.since, set())
            due = [key for key in self._ticks if key not in woken]
            woken.update(due)
            for key in due:
                del self._ticks[key]
                put(self._client, key, b"t")

    def _fire_ticks(self) -> float:
        """Set the wake keys whose time has come; return the seconds until the next one."""
        now = time.monotonic()
        with self._lock:  # under the lock: an untick()ed key is never set afterwards
            due = [key for key, at in self._ticks.items() if at <= now]
            for key in due:
                del self._ticks[key]
                put(self._client, key, b"t")
            upcoming = min(self._ticks.values(), default=now + 3600.0)
        return max(0.0, upcoming - now)

    def _run(self) -> None:
        next_beat = time.monotonic() + self._every
        while True:
            try:
                until_tick = self._fire_ticks()
                wait = min(until_tick, max(0.0, next_beat - time.monotonic()))
                self._wake.wait(wait)
                self._wake.clear()
                if time.monotonic() >= next_beat:
                    if not self._armed(self._beat):
                        return
                    next_beat = time.monotonic() + self._every
            except Exception:
                return  # the store is gone (process group destroyed or its host died): nothing left to beat

    def _armed(self, beat: Callable[[], bool]) -> bool:
        """Run ``beat``, armed on the watchdog while a waiter waits (outside blocks a slow store is not ours to cut)."""
        if self._port is None or not self._ticks or not watchdog_enabled():
            return beat()
        dog = watchdog()
        token = dog.arm(time.monotonic() + heartbeat_timeout(), self._port)
        try:
            return beat()
        finally:
            dog.disarm(token)


class Watch:
    """This rank's view of one peer's heartbeat, by this rank's own clock (no clock skew between hosts)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.value: bytes | None = None
        self.since = time.monotonic()
        self.read_at = float("-inf")  # when the value was last read

    def observe(self, value: bytes | None, now: float) -> float:
        """Record ``value``; return for how long it has not changed (0 when it just did)."""
        if value != self.value:
            self.value, self.since = value, now
        return now - self.since


class Lingering:
    """Rank 0's last block, whose readers may still be using the store that rank 0's process hosts.

    Under ``env://`` launches the store lives in rank 0's process: if rank 0 ended its process right after
    a block, the others could lose the store while reading the outcome. Rather than make every block wait,
    rank 0 keeps the store alive and, at interpreter exit, waits (bounded, on one key) until the others
    acknowledged. The next block needs nothing: its entry proves everyone finished the previous one.
    """

    pending: tuple[Store, BlockKeys, int] | None = None
    registered = False

    @classmethod
    def hold(cls, store: Store, keys: BlockKeys, expected: int) -> None:
        cls.pending = (store, keys, expected)
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
        held, keys, _ = pending
        try:
            if held is store or held.check([keys.acked]):
                cls.pending = None
        except Exception:
            cls.pending = None  # the store is gone: nothing left to protect

    @classmethod
    def drain(cls) -> None:
        pending, cls.pending = cls.pending, None
        if pending is None:
            return
        store, keys, _ = pending
        try:
            store.wait([keys.acked], timedelta(seconds=heartbeat_timeout()))
        except Exception:
            return  # the others are gone already, or did not answer in time


_THREAD_CLIENTS = threading.local()


def _clients_of_this_thread() -> weakref.WeakKeyDictionary[Store, Store]:
    clients: weakref.WeakKeyDictionary[Store, Store] | None = getattr(_THREAD_CLIENTS, "clients", None)
    if clients is None:
        clients = _THREAD_CLIENTS.clients = weakref.WeakKeyDictionary()
    return clients


def client_of_this_thread(store: Store) -> Store:
    clients = _clients_of_this_thread()
    client = clients.get(store)
    if client is None:
        client = clients[store] = clone(store)
    return client


def forget_client_of_this_thread(store: Store) -> None:
    """Drop this thread's client of ``store`` (a call of it is stuck): the next block clones a new one."""
    _clients_of_this_thread().pop(store, None)


_WATCHING = threading.Event()


def watch_for_groups() -> bool:
    """Beat from the moment a process group exists, not from the first block; True when watching starts.

    A rank that dies before its first scheduled block has then beaten, so the ranks waiting at that block's
    entry declare it dead instead of waiting for it forever. A daemon thread looks for a new default process
    group in this process only (no store request), five times a second for the first minute and once a second
    after that; once one exists, the rank beats as it would from its first block (2 store requests per beat).
    A forked child watches too, unless it was forked with a process group already (a DataLoader worker: a copy,
    not a rank). ``IGNITE_EXT_EARLY_HEARTBEAT=0`` turns this off, so that beats start with the first block.

    Examples:
        >>> import os
        >>> from ignite_ext.distributed._heartbeat import watch_for_groups
        >>> os.environ["IGNITE_EXT_EARLY_HEARTBEAT"] = "0"
        >>> watch_for_groups()
        False
        >>> del os.environ["IGNITE_EXT_EARLY_HEARTBEAT"]

    .. versionadded:: 0.2.0
    """
    if os.environ.get("IGNITE_EXT_EARLY_HEARTBEAT", "1") == "0":
        return False
    if not _WATCHING.is_set():
        _WATCHING.set()
        threading.Thread(target=_watch, name="ignite_ext-group-watch", daemon=True).start()
        os.register_at_fork(after_in_child=_after_fork)
    return True


def _after_fork() -> None:
    _WATCHING.clear()  # the thread did not come along
    if default_store() is None:
        _WATCHING.set()
        threading.Thread(target=_watch, name="ignite_ext-group-watch", daemon=True).start()


def _watch() -> None:
    import torch.distributed

    seen: weakref.ref[Store] | None = None  # weak: a destroyed group's store must be free to go
    started = time.monotonic()
    while True:
        time.sleep(0.2 if time.monotonic() - started < 60 else 1.0)
        try:
            store = default_store()
            if store is None or (seen is not None and seen() is store) or torch.distributed.get_world_size() < 2:
                continue
            seen = weakref.ref(store)
            Heartbeat.ensure(store, torch.distributed.get_rank(), torch.distributed.get_world_size())
        except Exception:
            continue  # a group being torn down meanwhile: the next look sees what is left
