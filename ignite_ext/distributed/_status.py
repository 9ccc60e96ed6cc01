"""How ranks learn that the ranks they wait for finished, failed or died.

Two channels implement one protocol (:class:`Channel`):

* :class:`StoreChannel`, on native backends (gloo, nccl, ...): waits poll the process group's key-value store
  (the TCPStore of ``env://``/torchrun launches), never a collective, so a first rank may work far longer than
  the process group's timeout. Every rank inside a scheduler beats a heartbeat key from a daemon thread;
  a rank whose heartbeat stops (SIGKILL, OOM kill, machine loss) is declared dead by whoever waits for it,
  exactly once (``compare_set``), and everyone waiting learns it as a failure instead of hanging.
* :class:`CollectiveChannel`, everywhere else (Horovod, XLA, or when forced): all ranks step through the
  plan's waves in lockstep, one small ``all_gather`` per wave. Waits are bounded by the backend's own
  collective timeout, and a dead rank is detected only as far as the backend detects it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import ignite.distributed as idist

from ignite_ext.distributed._collective import all_gather_bytes, all_gather_rows
from ignite_ext.distributed.errors import RankFailedError, RankFailure
from ignite_ext.distributed.policies import Plan

__all__ = ["Channel", "CollectiveChannel", "StoreChannel", "make_channel"]

T = TypeVar("T")

_LOGGER_NAME = "ignite_ext.distributed"


def _log() -> logging.Logger:
    """The scheduler's logger, set up the ignite way on first use unless the application configured it.

    ``distributed_rank=0`` because the lines that matter come from waiting ranks, which ignite's default
    (output on rank 0 only) would silence.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        from ignite.utils import setup_logger

        setup_logger(_LOGGER_NAME, level=logging.INFO, distributed_rank=0)
    return logger


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def heartbeat_timeout() -> float:
    """Seconds without a heartbeat after which a rank counts as dead (``IGNITE_EXT_HEARTBEAT_TIMEOUT``)."""
    return _env_float("IGNITE_EXT_HEARTBEAT_TIMEOUT", 30.0)


def log_interval() -> float:
    """Seconds between two "still waiting" log lines (``IGNITE_EXT_WAIT_LOG_INTERVAL``)."""
    return _env_float("IGNITE_EXT_WAIT_LOG_INTERVAL", 30.0)


class Channel(ABC):
    """The waiting protocol of one scheduled block on one rank: entry exchange, then the plan's waits."""

    def __init__(self, rank: int, world_size: int, label: str, timeout: float | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.label = label
        self.timeout = timeout
        self.plan = Plan(())

    @abstractmethod
    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """Give every rank's entry (``mine``) to ``judge`` and return its verdict, the same on every rank."""

    def start(self, plan: Plan) -> None:
        """Adopt the plan agreed on; ``wait_turn`` and ``leave`` follow it."""
        self.plan = plan

    @abstractmethod
    def wait_turn(self) -> list[RankFailure]:
        """Block until this rank may run; return the failures it inherits (then it must not run)."""

    @abstractmethod
    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        """Report this rank's outcome; unless it failed, wait for everyone and return every original failure.

        ``linger=False`` (a rank that timed out) leaves as soon as its outcome is posted.
        """


# --------------------------------------------------------------------------------------------------- store


def _payload(failures: Iterable[RankFailure]) -> bytes:
    return json.dumps([[f.rank, f.exc_type, f.message] for f in failures]).encode()


def _failures(payload: bytes) -> list[RankFailure]:
    return [RankFailure(int(r), str(t), str(m)) for r, t, m in json.loads(payload.decode())]


class _Heartbeat:
    """One daemon thread per process and store: bumps ``ignite_ext/hb/<rank>`` and runs deferred deletions."""

    _instances: weakref.WeakKeyDictionary[Any, _Heartbeat] = weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(self, store: Any, rank: int) -> None:
        self._store = weakref.ref(store)
        self._rank = rank
        self._pending: list[str] = []
        # Keys of the block in progress that only this rank knows of (its failure details): deleted with the rest
        # of the block's keys, once the next block's verdict shows that every rank has left it.
        self.carried: list[str] = []
        self._wake = threading.Event()
        self._beat()
        threading.Thread(target=self._run, name="ignite_ext-heartbeat", daemon=True).start()

    @classmethod
    def ensure(cls, store: Any, rank: int) -> _Heartbeat:
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
        store.add(f"ignite_ext/hb/{self._rank}", 1)
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

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self.value: bytes | None = None
        self.since = time.monotonic()
        self.next_check = self.since

    def stale(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + 0.5
        key = f"ignite_ext/hb/{self.rank}"
        value = self.store.get(key) if self.store.check([key]) else None
        if value != self.value:
            self.value, self.since = value, now
        return now - self.since > heartbeat_timeout()


_ABSENT = b"\x00"  # compare_set on a missing key with this expected value reads without writing


class _Lingering:
    """Rank 0's last block, whose readers may still be using the store that rank 0's process hosts.

    Under ``env://`` launches the store lives in rank 0's process: if rank 0 ended its process right after
    a block, the others could lose the store while reading the outcome. Rather than make every block wait,
    rank 0 keeps the store alive and, at interpreter exit, waits (bounded) until the others acknowledged.
    The next block needs nothing: its entry collective proves everyone finished the previous one.
    """

    pending: tuple[Any, str, int] | None = None
    registered = False

    @classmethod
    def hold(cls, store: Any, acks_key: str, expected: int) -> None:
        cls.pending = (store, acks_key, expected)
        if not cls.registered:
            atexit.register(cls.drain)
            cls.registered = True

    @classmethod
    def release(cls, store: Any | None = None) -> None:
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

    Keys of block ``seq`` live under ``ignite_ext/sched/<seq>/``: ``out/<rank>`` holds a rank's outcome
    (written once, by it or by whoever declares it dead), ``exits`` counts the ranks that left (plus
    ``world_size + 1`` for each failed one, so one read tells both), ``fail/<i>`` the failures' details and
    ``acks`` the ranks that have read the outcome.
    """

    def __init__(self, rank: int, world_size: int, label: str, timeout: float | None, store: Any, seq: int) -> None:
        super().__init__(rank, world_size, label, timeout)
        self.store = store
        self.ns = f"ignite_ext/sched/{seq}"
        self._ring = rank + 1
        self.seq = seq
        self.heartbeat = self._guarded(lambda: _Heartbeat.ensure(store, rank))

    def _forget_previous_block(self) -> None:
        # Called once this block's verdict is known: rank 0 judged only after every rank had entered this
        # block, so every rank has left the previous one and none reads its keys any more.
        _Lingering.release(self.store)
        if self.seq > 0:
            prev = f"ignite_ext/sched/{self.seq - 1}"
            shared = [f"{prev}/{k}" for k in ("exits", "nfail", "acks", "entered", "verdict")] if self.rank == 0 else []
            carried, self.heartbeat.carried = self.heartbeat.carried, []
            self.heartbeat.delete_later([f"{prev}/out/{self.rank}", f"{prev}/entry/{self.rank}", *shared, *carried])

    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """Rank 0 collects every entry from the store, judges, and publishes the verdict: no collective.

        A late rank therefore delays the others without running into the process group's timeout.
        """
        verdict = self._guarded(lambda: self._exchange(mine, judge))
        self._forget_previous_block()
        return verdict

    def _exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        self.store.set(self._key("entry", self.rank), mine)
        entered = self.store.add(self._key("entered"), 1)
        verdict_key = self._key("verdict")
        if self.rank != 0:
            return self._wait(lambda: self._read(verdict_key), lambda: [0], "rank 0 to check the arguments")
        if entered < self.world_size:
            self._wait(self._all_entered, self._not_entered, "every rank to enter")
        keys = [self._key("entry", r) for r in range(self.world_size)]
        verdict = judge([bytes(v) for v in self.store.multi_get(keys)])
        self.store.set(verdict_key, verdict)
        return verdict

    def _all_entered(self) -> bool | None:
        return True if int(self.store.add(self._key("entered"), 0)) >= self.world_size else None

    def _not_entered(self) -> list[int]:
        # Only ranks that have a heartbeat (they used a scheduler before) can be told dead from merely late.
        missing = [r for r in range(self.world_size) if not self.store.check([self._key("entry", r)])]
        return [r for r in missing if self.store.check([f"ignite_ext/hb/{r}"])]

    def _key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    def _read(self, key: str) -> bytes | None:
        value = bytes(self.store.compare_set(key, _ABSENT, b"-"))
        return None if value == _ABSENT else value

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
                _log().info("rank %d has waited %.0f s for %s (%s)", self.rank, waited, what, self.label)
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
                [RankFailure(peer, "RankDied", f"no heartbeat for {silent_for:.0f} s before entering")],
                f"rank {self.rank} waiting at the entry ({self.label})",
            )
        # The noticing rank is part of the message so that two ranks declaring the same death write different
        # payloads, and compare_set tells exactly one of them that it won.
        failure = RankFailure(
            peer, "RankDied", f"no heartbeat for {silent_for:.0f} s, noticed by rank {self.rank} (killed or hung)"
        )
        payload = _payload([failure])
        if bytes(self.store.compare_set(self._key("out", peer), "", payload)) == payload:
            _log().warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
            self._record_exit([failure])
            if peer != 0:
                self.store.add(self._key("acks"), 1)

    def _record_exit(self, own: list[RankFailure]) -> None:
        if own:
            index = self.store.add(self._key("nfail"), 1)
            self.store.set(self._key("fail", index), _payload(own))
            self.heartbeat.carried.append(self._key("fail", index))
        self.store.add(self._key("exits"), 1 + (self.world_size + 1) * bool(own))

    def wait_turn(self) -> list[RankFailure]:
        return self._guarded(self._wait_turn)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        return self._guarded(lambda: self._leave(own, inherited, linger))

    def _wait_turn(self) -> list[RankFailure]:
        inherited: list[RankFailure] = []
        for peer in sorted(self.plan.turns[self.rank].after):
            key = self._key("out", peer)
            outcome = self._wait(lambda k=key: self._read(k), lambda p=peer: [p], f"rank {peer}")  # type: ignore[misc]
            inherited += _failures(outcome)
        return sorted(set(inherited), key=lambda f: f.rank)

    def _leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool) -> list[RankFailure]:
        payload = _payload(own or inherited)
        if bytes(self.store.compare_set(self._key("out", self.rank), "", payload)) != payload:
            raise RankFailedError(
                [RankFailure(self.rank, "RankDied", "declared dead by its peers after its heartbeat stopped")],
                f"rank {self.rank}",
            )
        self._record_exit(own)
        found = own + inherited
        if not found:
            exits = self._wait(self._everyone_left, self._next_unexited, "every rank to finish")
            for i in range(1, exits // (self.world_size + 1) + 1):
                found += _failures(self.store.get(self._key("fail", i)))
        if self.rank != 0:
            self.store.add(self._key("acks"), 1)
        elif linger:
            _Lingering.hold(self.store, self._key("acks"), self.world_size - 1)
        return sorted(found, key=lambda f: f.rank)

    def _everyone_left(self) -> int | None:
        exits = int(self.store.add(self._key("exits"), 0))
        return exits if exits % (self.world_size + 1) == self.world_size else None

    def _next_unexited(self) -> list[int]:
        # Each waiter watches the first rank after it (cyclically) that has not left yet: every live waiter
        # covers a different stretch of the ring, so a dead rank is noticed without everyone polling everyone.
        for step in range(self.world_size - 1):
            peer = (self._ring + step) % self.world_size
            if peer == self.rank:
                break
            if self._read(self._key("out", peer)) is None:
                self._ring = peer
                return [peer]
        return []

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (TimeoutError, RankFailedError):
            raise
        except RuntimeError as exc:  # DistStoreError and friends: the store itself is unreachable
            raise RankFailedError(
                [RankFailure(-1, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")],
                f"rank {self.rank} lost the rendezvous store while waiting ({self.label}); "
                "the rank hosting it (rank 0 under env:// launches) has probably died",
            ) from exc


# ---------------------------------------------------------------------------------------------- collective

_OK, _FAILED, _SKIPPED = 0, 1, 2


class CollectiveChannel(Channel):
    """Steps all ranks through the plan's waves in lockstep, one ``all_gather`` per wave."""

    def __init__(self, rank: int, world_size: int, label: str, timeout: float | None) -> None:
        super().__init__(rank, world_size, label, timeout)
        self.levels: tuple[int, ...] = ()
        self.level = 0
        self.wave = 0
        self.failed: dict[int, list[RankFailure]] = {}  # rank -> the original failures it carries
        self.original: list[RankFailure] = []

    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """Gather every entry with collectives; every rank judges the same entries itself."""
        return judge(all_gather_bytes(mine))

    def start(self, plan: Plan) -> None:
        """Adopt the plan and compute the waves to step through."""
        super().start(plan)
        self.levels = plan.levels()
        self.level = self.levels[self.rank]

    def _boundary(self, state: int, own: list[RankFailure]) -> None:
        states = [row[0] for row in all_gather_rows([state if self.level == self.wave else _OK])]
        if any(s == _FAILED for s in states):
            blobs = all_gather_bytes(_payload(own) if states[self.rank] == _FAILED else b"[]")
            for r, s in enumerate(states):
                if s == _FAILED:
                    self.original += _failures(blobs[r])
        for r, s in enumerate(states):
            if s != _OK:
                self.failed[r] = [f for f in self.original if s == _FAILED and f.rank == r] or self._inherited(r)
        self.wave += 1

    def _inherited(self, rank: int) -> list[RankFailure]:
        out = [f for a in self.plan.turns[rank].after for f in self.failed.get(a, [])]
        return sorted(set(out), key=lambda f: f.rank)

    def wait_turn(self) -> list[RankFailure]:
        while self.wave < self.level:
            self._boundary(_OK, [])
        return self._inherited(self.rank)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        state = _FAILED if own else _SKIPPED if inherited else _OK
        last = max(self.levels)
        while self.wave <= last:
            self._boundary(state, own)
        return sorted(set(self.original), key=lambda f: f.rank)


def _native_store() -> Any | None:
    if os.environ.get("IGNITE_EXT_SCHEDULER_CHANNEL", "").lower() == "collective":
        return None
    if idist.model_name() != "native-dist":
        return None
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def make_channel(rank: int, world_size: int, label: str, timeout: float | None, seq: int) -> Channel:
    """Return the store channel on native backends and the collective one elsewhere."""
    store = _native_store() if world_size > 1 else None
    if store is None:
        return CollectiveChannel(rank, world_size, label, timeout)
    return StoreChannel(rank, world_size, label, timeout, store, seq)
