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

_LOG = logging.getLogger("ignite_ext.distributed")


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
    """The waiting protocol of one scheduled block on one rank."""

    def __init__(self, plan: Plan, rank: int, label: str, timeout: float | None) -> None:
        self.plan = plan
        self.rank = rank
        self.label = label
        self.timeout = timeout

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


class StoreChannel(Channel):
    """Waits through the process group's store; see the module docstring."""

    def __init__(self, plan: Plan, rank: int, label: str, timeout: float | None, store: Any, seq: int) -> None:
        super().__init__(plan, rank, label, timeout)
        self.store = store
        self.world_size = len(plan.turns)
        self.ns = f"ignite_ext/sched/{seq}"
        self.heartbeat = _Heartbeat.ensure(store, rank)
        self._ring = rank + 1
        if seq > 0:
            # Every rank has passed this block's entry collective, so none still reads the previous block's keys.
            prev = f"ignite_ext/sched/{seq - 1}"
            own = [f"{prev}/done/{rank}", f"{prev}/exit/{rank}"]
            shared = [f"{prev}/{k}" for k in ("exits", "all_exited", "nfail", "acks")] if rank == 0 else []
            self.heartbeat.delete_later(own + shared)

    def _key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    def _claim(self, key: str, payload: bytes) -> bytes:
        return bytes(self.store.compare_set(key, "", payload))

    def _wait(
        self,
        ready: Callable[[], bool],
        suspects: Callable[[], list[int]],
        what: str,
        patience: float | None = None,
    ) -> None:
        """Poll ``ready`` with backoff; declare dead suspects whose heartbeat stopped; log and time out.

        With ``patience``, give up quietly once nobody is left to suspect and that many seconds have passed.
        """
        start = time.monotonic()
        next_log = start + log_interval()
        delay = 1e-4
        watches: dict[int, _Watch] = {}
        while not ready():
            now = time.monotonic()
            if self.timeout is not None and now - start > self.timeout:
                raise TimeoutError(f"rank {self.rank} waited {now - start:.0f} s for {what} ({self.label})")
            if now >= next_log:
                _LOG.info("rank %d has waited %.0f s for %s (%s)", self.rank, now - start, what, self.label)
                next_log = now + log_interval()
            peers = suspects()
            if patience is not None and not peers and now - start > patience:
                return
            for peer in peers:
                watch = watches.setdefault(peer, _Watch(self.store, peer))
                if watch.stale():
                    self._declare_dead(peer, now - watch.since)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _declare_dead(self, peer: int, silent_for: float) -> None:
        # The noticing rank is part of the message so that two ranks declaring the same death write different
        # payloads, and compare_set tells exactly one of them that it won.
        failure = RankFailure(
            peer, "RankDied", f"no heartbeat for {silent_for:.0f} s, noticed by rank {self.rank} (killed or hung)"
        )
        payload = _payload([failure])
        self._claim(self._key("done", peer), payload)
        if self._claim(self._key("exit", peer), payload) == payload:
            _LOG.warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
            self._record_exit([failure])
            if peer != 0:
                self.store.add(self._key("acks"), 1)

    def _record_exit(self, own: list[RankFailure]) -> None:
        if own:
            index = self.store.add(self._key("nfail"), 1)
            self.store.set(self._key("fail", index), _payload(own))
        if self.store.add(self._key("exits"), 1) == self.world_size:
            self.store.set(self._key("all_exited"), b"1")

    def _done(self, peer: int) -> bool:
        return bool(self.store.check([self._key("done", peer)]))

    def wait_turn(self) -> list[RankFailure]:
        return self._guarded(self._wait_turn)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        return self._guarded(lambda: self._leave(own, inherited, linger))

    def _wait_turn(self) -> list[RankFailure]:
        inherited: list[RankFailure] = []
        for peer in sorted(self.plan.turns[self.rank].after):
            self._wait(lambda p=peer: self._done(p), lambda p=peer: [p], f"rank {peer}")  # type: ignore[misc]
            inherited += _failures(self.store.get(self._key("done", peer)))
        return sorted(set(inherited), key=lambda f: f.rank)

    def _leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool) -> list[RankFailure]:
        payload = _payload(own or inherited)
        declared_dead = self._claim(self._key("exit", self.rank), payload) != payload
        self._claim(self._key("done", self.rank), payload)
        if declared_dead:
            raise RankFailedError(
                [RankFailure(self.rank, "RankDied", "declared dead by its peers after its heartbeat stopped")],
                f"rank {self.rank}",
            )
        self._record_exit(own)
        found = own + inherited
        if not found:
            self._wait(self._all_exited, self._next_unexited, "every rank to finish")
            count = int(self.store.add(self._key("nfail"), 0))
            found = [f for i in range(1, count + 1) for f in _failures(self.store.get(self._key("fail", i)))]
        self._acknowledge(linger)
        return sorted(found, key=lambda f: f.rank)

    def _acknowledge(self, linger: bool) -> None:
        """Tell rank 0 this rank has read all it needs; rank 0 waits for that before it leaves.

        Under ``env://`` launches rank 0's process hosts the store: if it left first (say, the block is the
        last thing the script does), the others would lose the store in the middle of reading the outcome.
        """
        if self.rank != 0:
            self.store.add(self._key("acks"), 1)
            return
        if not linger:
            return
        self._wait(
            lambda: int(self.store.add(self._key("acks"), 0)) >= self.world_size - 1,
            self._next_unexited,
            "every rank to read the outcome",
            patience=heartbeat_timeout(),
        )

    def _all_exited(self) -> bool:
        return bool(self.store.check([self._key("all_exited")]))

    def _next_unexited(self) -> list[int]:
        # Each waiter watches the first rank after it (cyclically) that has not left yet: every live waiter
        # covers a different stretch of the ring, so a dead rank is noticed without everyone polling everyone.
        start = self._ring
        for step in range(self.world_size - 1):
            peer = (start + step) % self.world_size
            if peer == self.rank:
                break
            if not self.store.check([self._key("exit", peer)]):
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

    def __init__(self, plan: Plan, rank: int, label: str, timeout: float | None) -> None:
        super().__init__(plan, rank, label, timeout)
        self.levels = plan.levels()
        self.level = self.levels[rank]
        self.wave = 0
        self.failed: dict[int, list[RankFailure]] = {}  # rank -> the original failures it carries
        self.original: list[RankFailure] = []

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


def make_channel(plan: Plan, rank: int, label: str, timeout: float | None, seq: int) -> Channel:
    """Return the store channel on native backends and the collective one elsewhere."""
    store = _native_store()
    if store is None:
        return CollectiveChannel(plan, rank, label, timeout)
    return StoreChannel(plan, rank, label, timeout, store, seq)
