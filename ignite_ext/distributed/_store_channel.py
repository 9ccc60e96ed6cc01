"""The store channel: waits through the process group's store, heartbeats, and dead ranks declared exactly once.

See :mod:`ignite_ext.distributed._channel` for the protocol and :mod:`ignite_ext.distributed._store` for the keys.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TypeVar

from ignite_ext.distributed._channel import (
    Channel,
    decode_failures,
    encode_failures,
    heartbeat_timeout,
    log,
    log_interval,
)
from ignite_ext.distributed._state import GroupState
from ignite_ext.distributed._store import BlockKeys, Store, heartbeat_key, put, put_once, read
from ignite_ext.errors import RankDiedError, RankFailedError, RankFailure, StoreLostError

__all__ = ["StoreChannel"]

T = TypeVar("T")

# The exc_type of a dead rank's failure: the error it raises itself if it is still alive to learn of it.
_DIED = RankDiedError.__name__


class _Heartbeat:
    """One daemon thread per process and store: bumps ``ignite_ext/hb/<rank>`` and runs deferred deletions."""

    _instances: weakref.WeakKeyDictionary[Store, _Heartbeat] = weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(self, store: Store, rank: int) -> None:
        self._store = weakref.ref(store)
        self._rank = rank
        self._pending: list[str] = []
        self._wake = threading.Event()
        self._beat()
        threading.Thread(target=self._run, name="ignite_ext-heartbeat", daemon=True).start()

    @classmethod
    def ensure(cls, store: Store, rank: int) -> _Heartbeat:
        with cls._guard:
            hb = cls._instances.get(store)
            if hb is None:
                hb = cls._instances[store] = cls(store, rank)
            return hb

    def delete_later(self, keys: Iterable[str]) -> None:
        self._pending.extend(keys)

    def _beat(self) -> bool:
        store = self._store()
        if store is None:
            return False
        store.add(heartbeat_key(self._rank), 1)
        _Lingering.release()
        while self._pending:
            store.delete_key(self._pending.pop())
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait(max(0.05, heartbeat_timeout() / 6))
            try:
                if not self._beat():
                    return
            except Exception:
                return  # the store is gone (process group destroyed or its host died): nothing left to beat


class _Watch:
    """Tracks one peer's heartbeat counter by this rank's own clock (no clock skew between hosts)."""

    def __init__(self, store: Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.value: bytes | None = None
        self.since = time.monotonic()
        self.next_check = self.since

    def stale(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + 0.5
        key = heartbeat_key(self.rank)
        value = self.store.get(key) if self.store.check([key]) else None
        if value != self.value:
            self.value, self.since = value, now
        return now - self.since > heartbeat_timeout()


class _Lingering:
    """Rank 0's last block, whose readers may still be using the store that rank 0's process hosts.

    Under ``env://`` launches the store lives in rank 0's process: if rank 0 ended its process right after
    a block, the others could lose the store while reading the outcome. Rather than make every block wait,
    rank 0 keeps the store alive and, at interpreter exit, waits (bounded) until the others acknowledged.
    The next block needs nothing: its entry collective proves everyone finished the previous one.
    """

    pending: tuple[Store, str, int] | None = None
    registered = False

    @classmethod
    def hold(cls, store: Store, acks_key: str, expected: int) -> None:
        cls.pending = (store, acks_key, expected)
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
        held, key, expected = pending
        try:
            if held is store or int(held.add(key, 0)) >= expected:
                cls.pending = None
        except Exception:
            cls.pending = None  # the store is gone: nothing left to protect

    @classmethod
    def drain(cls) -> None:
        pending, cls.pending = cls.pending, None
        if pending is None:
            return
        store, key, expected = pending
        end = time.monotonic() + heartbeat_timeout()
        try:
            while int(store.add(key, 0)) < expected and time.monotonic() < end:
                time.sleep(0.005)
        except Exception:
            return  # the others are gone already


def _backoff(waited: float) -> float:
    # Short waits (an empty block) are answered within a fraction of a millisecond; long ones (a download)
    # poll gently.
    if waited < 0.01:
        return 0.0001
    if waited < 0.2:
        return 0.0005
    return 0.02 if waited < 5.0 else 0.1


class StoreChannel(Channel):
    """Waits through the process group's store; see the module docstring.

    Its keys are those of :class:`~ignite_ext.distributed._store.BlockKeys`: ``out/<rank>`` holds a rank's
    outcome (written once, by it or by whoever declares it dead), ``exits`` counts the ranks that left (plus
    ``world_size + 1`` for each failed one, so one read tells both), ``fail/<i>`` the failures' details and
    ``acks`` the ranks that have read the outcome.
    """

    def __init__(
        self, rank: int, world_size: int, label: str, timeout: float | None, store: Store, seq: int, state: GroupState
    ) -> None:
        super().__init__(rank, world_size, label, timeout)
        self.store = store
        self.keys = BlockKeys(seq)
        self._ring = rank + 1
        self.seq = seq
        self.state = state
        self.heartbeat = self._guarded(lambda: _Heartbeat.ensure(store, rank))

    def _forget(self, mark: int) -> None:
        # Every rank has left every block below ``mark`` (the verdict's lowest low-water mark): nobody reads
        # their keys any more.
        _Lingering.release(self.store)
        for seq in self.state.forget_below(mark):
            self.heartbeat.delete_later([*BlockKeys(seq).deleted_by(self.rank), *self.state.carried.pop(seq, [])])

    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """Rank 0 collects every entry from the store, judges, and publishes the verdict: no collective.

        A late rank therefore delays the others without running into the process group's timeout. Each entry
        and the verdict carry a low-water mark line ahead of the payload (see :mod:`ignite_ext.distributed._state`).
        """

        def judge_marked(entries: list[bytes]) -> bytes:
            marks, payloads = zip(*(entry.split(b"\n", 1) for entry in entries), strict=True)
            return b"%d\n" % min(int(m) for m in marks) + judge(list(payloads))

        marked = b"%d\n" % self.state.low_water + mine
        mark, verdict = self._guarded(lambda: self._exchange(marked, judge_marked)).split(b"\n", 1)
        self._forget(int(mark))
        return verdict

    def _exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        put(self.store, self.keys.entry(self.rank), mine)
        entered = self.store.add(self.keys.entered, 1)
        verdict_key = self.keys.verdict
        if self.rank != 0:
            return self._wait(lambda: self._read(verdict_key), lambda: [0], "rank 0 to check the arguments")
        if entered < self.world_size:
            self._wait(self._all_entered, self._not_entered, "every rank to enter")
        keys = [self.keys.entry(r) for r in range(self.world_size)]
        verdict = judge([bytes(v) for v in self.store.multi_get(keys)])
        put(self.store, verdict_key, verdict)
        return verdict

    def _all_entered(self) -> bool | None:
        return True if int(self.store.add(self.keys.entered, 0)) >= self.world_size else None

    def _not_entered(self) -> list[int]:
        # Only ranks that have a heartbeat (they used a scheduler before) can be told dead from merely late.
        missing = [r for r in range(self.world_size) if not self.store.check([self.keys.entry(r)])]
        return [r for r in missing if self.store.check([heartbeat_key(r)])]

    def _read(self, key: str) -> bytes | None:
        return read(self.store, key)

    def _wait(self, poll: Callable[[], T | None], suspects: Callable[[], list[int]], what: str) -> T:
        """Poll until ``poll`` returns a value; declare dead suspects whose heartbeat stopped; log; time out."""
        start = time.monotonic()
        next_log = start + log_interval()
        watches: dict[int, _Watch] = {}
        while (value := poll()) is None:
            now = time.monotonic()
            waited = now - start
            if self.timeout is not None and waited > self.timeout:
                raise TimeoutError(f"rank {self.rank} waited {waited:.0f} s for {what} ({self.label})")
            if now >= next_log:
                log().info("rank %d has waited %.0f s for %s (%s)", self.rank, waited, what, self.label)
                next_log = now + log_interval()
            for peer in suspects() if waited > 0.2 else []:
                watch = watches.setdefault(peer, _Watch(self.store, peer))
                if watch.stale():
                    self._declare_dead(peer, now - watch.since)
            time.sleep(_backoff(waited))
        return value

    def _declare_dead(self, peer: int, silent_for: float) -> None:
        if not self.plan.turns:  # still at the entry: nobody has run anything, so everyone just stops
            raise RankFailedError(
                [RankFailure(peer, _DIED, f"no heartbeat for {silent_for:.0f} s before entering", died=True)],
                f"rank {self.rank} waiting at the entry ({self.label})",
            )
        # The noticing rank is part of the message so that two ranks declaring the same death write different
        # payloads, and compare_set tells exactly one of them that it won.
        failure = RankFailure(
            peer, _DIED, f"no heartbeat for {silent_for:.0f} s, noticed by rank {self.rank} (killed or hung)", died=True
        )
        if put_once(self.store, self.keys.outcome(peer), encode_failures([failure])):
            log().warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
            self._record_exit([failure])
            if peer != 0:
                self.store.add(self.keys.acks, 1)

    def _record_exit(self, own: list[RankFailure]) -> None:
        if own:
            index = self.store.add(self.keys.nfail, 1)
            put(self.store, self.keys.fail(index), encode_failures(own))
            self.state.carried.setdefault(self.seq, []).append(self.keys.fail(index))
        self.store.add(self.keys.exits, 1 + (self.world_size + 1) * bool(own))

    def wait_turn(self) -> list[RankFailure]:
        return self._guarded(self._wait_turn)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        return self._guarded(lambda: self._leave(own, inherited, linger))

    def _wait_turn(self) -> list[RankFailure]:
        inherited: list[RankFailure] = []
        for peer in sorted(self.plan.turns[self.rank].after):
            key = self.keys.outcome(peer)
            outcome = self._wait(lambda k=key: self._read(k), lambda p=peer: [p], f"rank {peer}")  # type: ignore[misc]
            inherited += decode_failures(outcome)
        return sorted(set(inherited), key=lambda f: f.rank)

    def _leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool) -> list[RankFailure]:
        if not put_once(self.store, self.keys.outcome(self.rank), encode_failures(own or inherited)):
            raise RankDiedError(
                [RankFailure(self.rank, _DIED, "declared dead by its peers after its heartbeat stopped", died=True)],
                f"rank {self.rank}",
            )
        self._record_exit(own)
        found = own + inherited
        if not found:
            exits = self._wait(self._everyone_left, self._next_unexited, "every rank to finish")
            for i in range(1, exits // (self.world_size + 1) + 1):
                found += decode_failures(self.store.get(self.keys.fail(i)))
        if self.rank != 0:
            self.store.add(self.keys.acks, 1)
        elif linger:
            _Lingering.hold(self.store, self.keys.acks, self.world_size - 1)
        return sorted(found, key=lambda f: f.rank)

    def _everyone_left(self) -> int | None:
        exits = int(self.store.add(self.keys.exits, 0))
        return exits if exits % (self.world_size + 1) == self.world_size else None

    def _next_unexited(self) -> list[int]:
        # Each waiter watches the first rank after it (cyclically) that has not left yet: every live waiter
        # covers a different stretch of the ring, so a dead rank is noticed without everyone polling everyone.
        for step in range(self.world_size - 1):
            peer = (self._ring + step) % self.world_size
            if peer == self.rank:
                break
            if self._read(self.keys.outcome(peer)) is None:
                self._ring = peer
                return [peer]
        return []

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (TimeoutError, RankFailedError):
            raise
        except RuntimeError as exc:  # DistStoreError and friends: the store itself is unreachable
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise StoreLostError(
                cause,
                f"rank {self.rank} waiting ({self.label}); the process hosting the store (rank 0's under env:// "
                "launches) has exited or its host is unreachable",
            ) from exc
