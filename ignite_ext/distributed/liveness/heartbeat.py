"""The failure detector's driver: one daemon thread per process and store that beats, watches and posts cuts.

The decisions are :class:`~ignite_ext.distributed.liveness.detector.Detector`'s; this module only does the reads
and writes it asks for, on a store client of its own (a blocked ``wait`` holds its client's lock).

**A beat** (every ``T/6``): ``add(hb/<rank>, 1)``, then one ``multi_get`` of the watched successor's counter and
of the group's cut counter (``ignite_ext/cuts``): 2 requests. Both keys exist from the start (the watcher creates
its successor's counter with ``add(.., 0)``), so the read never blocks, and a successor that never beat is silent
from the moment the watch began.

**A cut** the detector proposes is posted with ``compare_set`` on ``ignite_ext/cut/<i>`` for the next number
``i``: the first proposal of each number wins, the others adopt it (and propose what it lacks as the next
number); the counter then moves from ``i - 1`` to ``i`` (``compare_set``: exactly once). Every process reads the
counter at each beat, so each learns of a new cut within ``T/6`` of its posting, reads it (one ``get``) and tells
its errands (:class:`Errand`): the scheduler's wakes every thread of the process that waits in a scheduled block,
which then declares the cut's ranks dead in its block.
The cost of a failure: per suspicion, two reads of ``N`` counters by each watcher of a dead rank; per cut, one
``get`` per process.

**Errands.** Beats and cuts are all this module does. A layer above that needs work done off its threads' path
(the scheduler: wake-up ticks, deferred deletes, acknowledgements, see :mod:`ignite_ext.distributed._chores`)
hands the thread an :class:`Errand`, run on the thread's client: no second thread per process.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from ignite_ext.distributed.liveness.detector import Cut, Detector
from ignite_ext.distributed.liveness.keeper import process_identity
from ignite_ext.distributed.liveness.settings import beat_interval, early_heartbeat, heartbeat_timeout, process_watch
from ignite_ext.distributed.liveness.watch import NOT_YET, CutListener, KeeperHandle, proven_wire
from ignite_ext.distributed.store.clients import (
    Store,
    check,
    clone,
    default_store,
    group_store,
    put,
    put_once,
    read,
)
from ignite_ext.distributed.store.keys import CUTS_KEY, cut_key, heartbeat_key, proc_key
from ignite_ext.distributed.store.watchdog import store_port, watchdog, watchdog_enabled

__all__ = ["Errand", "Heartbeat", "watch_for_groups"]

_log = logging.getLogger(__name__)


class Errand(Protocol):
    """Work of a layer above liveness that rides on the heartbeat thread, on its client (no thread of its own).

    The scheduler's chores are one (:mod:`ignite_ext.distributed._chores`); liveness knows nothing of what they do.
    Each call must be quick: it delays the next beat.

    .. versionadded:: 0.4.0
    """

    def fire(self, client: Store) -> float:
        """Do what is due now; return when the errand next needs the thread (monotonic; ``math.inf``: never)."""

    def after_beat(self, client: Store) -> None:
        """Run after each beat."""

    def on_cut(self, client: Store) -> None:
        """Run when this process adopts a cut (after the cut is in :meth:`Heartbeat.cuts`)."""

    def busy(self) -> bool:
        """Whether a thread of this process waits on the store: the beats are then armed on the watchdog."""

    def end(self, client: Store) -> None:
        """Run once as the thread leaves (interpreter exit, the process group destroyed)."""


class Heartbeat:
    """One daemon thread per process and store, on its own client: beats, runs the detector, shares the cuts.

    While a thread of this process waits in a scheduled block, each beat is armed on the watchdog: a store that
    does not answer a beat within the heartbeat timeout is lost for the waiters too, whose slices are long.
    """

    _instances: weakref.WeakKeyDictionary[Store, Heartbeat] = weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self._clock = clock  # a virtual one in the detector's simulations, which call _beat themselves (no thread)
        self._store = weakref.ref(store)
        self._client = clone(store)
        self.rank = rank
        self._every = beat_interval()
        self._port = store_port(self._client)
        self._errands: list[Errand] = []
        self._followers: list[Callable[[Store], None]] = []  # called after each beat, with this thread's client
        self._following = threading.Lock()  # held while they run
        self._thread: threading.Thread | None = None
        # When the thread wakes next unless woken (infinity while it is deciding): an errand due later needs no wake-up.
        self._sleeps_until = math.inf
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._cuts: list[Cut] = []
        self._detector = Detector(rank, world_size, heartbeat_timeout(), clock(), early_heartbeat())
        self._created: int | None = None  # the watched rank whose counter this thread made sure exists
        self._urgent = threading.Event()  # a cut was posted: beat now
        self._heard = 0  # the highest cut number the listener saw posted (its counter may move a moment later)
        self._keeper: KeeperHandle | None = None
        self._listener: CutListener | None = None
        self._watching = start and process_watch()  # the keeper and the listener are still to start
        self._watched = threading.Event()  # set once they run, or once it is known that they will not
        self._keeper_starting = False  # a keeper was started and has not said yet that it watches this rank
        self._tries = 0  # looks for the wire address so far (see _start_watching)
        self._next_try = 0.0  # when _start_watching looks again (monotonic)
        if not self._watching:
            self._watched.set()
        self._ended = threading.Lock()
        put_once(self._client, CUTS_KEY, b"0")
        self._beat()
        if start:  # the thread starts the keeper and the listener: not the caller, which may be a block's entry
            self._thread = threading.Thread(target=self._run, name="ignite_ext-heartbeat", daemon=True)
            self._thread.start()
            _stop_at_exit(self)

    @classmethod
    def ensure(cls, store: Store, rank: int, world_size: int) -> Heartbeat:
        """The heartbeat of ``store`` in this process, started on the first call."""
        with cls._guard:
            hb = cls._instances.get(store)
            if hb is None:
                hb = cls._instances[store] = cls(store, rank, world_size)
            return hb

    @classmethod
    def running(cls, store: Store) -> Heartbeat | None:
        """The heartbeat of ``store`` in this process, if one has started (none is started here)."""
        with cls._guard:
            return cls._instances.get(store)

    # --- what the waiters use (no request) ------------------------------------------------------------------------

    def wait_watching(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until this rank's keeper and cut listener run (or are known not to); True if so.

        A block's entry waits here, so that by the time its body runs a keeper beats for this rank whenever the
        body holds the GIL: a hold right after ``init_process_group`` is then not a death (the keeper and the
        listener start in the heartbeat thread, about 0.1-0.5 s after the group forms).
        """
        return self._watched.wait(seconds)

    def cuts(self) -> list[Cut]:
        """The group's cuts this process knows of, in order."""
        with self._lock:
            return list(self._cuts)

    @property
    def client(self) -> Store:
        """This thread's client of the store (its errands' requests go through it)."""
        return self._client

    def beating(self) -> bool:
        """Whether the thread runs (False where it was not started, or has ended)."""
        return self._thread is not None and self._thread.is_alive()

    def add_errand(self, errand: Errand) -> None:
        """Run ``errand`` in this thread from now on (see :class:`Errand`)."""
        with self._lock:
            self._errands.append(errand)
        self._wake.set()

    def wake_by(self, at: float) -> None:
        """Make the thread look at its errands by ``at`` (monotonic), if it would sleep past it."""
        with self._lock:
            due_earlier = at < self._sleeps_until
        if due_earlier:  # most slices end long after the next beat: waking the thread for them costs every wait
            self._wake.set()

    def follow(self, follower: Callable[[Store], None]) -> None:
        """Call ``follower`` after each beat, in the heartbeat thread, with its client (until :meth:`unfollow`).

        What runs there runs while the rank's main thread works in its block (a first rank's progress, its stall):
        it must be quick, and its store requests are the beat's, armed on the watchdog like them.
        """
        with self._lock:
            self._followers.append(follower)

    def unfollow(self, follower: Callable[[Store], None]) -> None:
        """Stop calling ``follower``: it is not called again, and a call under way is waited for, at most ``T``.

        A call blocked longer (on a store that stopped answering, which a beat outside a wait is not armed
        against) is left to end on its own: the follower must tell itself that it was unfollowed.
        """
        with self._lock:
            self._followers.remove(follower)
        if self._following.acquire(timeout=heartbeat_timeout()):
            self._following.release()

    # --- the thread -------------------------------------------------------------------------------------------------

    def _beat(self) -> bool:
        if self._store() is None:
            return False
        client, detector = self._client, self._detector
        client.add(heartbeat_key(self.rank), 1)
        watched = detector.watched
        if watched is not None and watched != self._created:
            client.add(heartbeat_key(watched), 0)  # so that the read below never blocks
            self._created = watched
        keys = [CUTS_KEY] if watched is None else [CUTS_KEY, heartbeat_key(watched)]
        values = client.multi_get(keys)
        now = self._clock()
        self._learn(int(values[0]), self._heard, now)
        # A rank in a cut (it was stopped or cut off) proposes none: its view of the others' silence is stale.
        alive = not any(self.rank in cut.ranks for cut in self._cuts)
        suspect = (
            alive and watched is not None and watched == detector.watched and detector.observe(now, int(values[1]))
        )
        if suspect and (cut := detector.on_snapshot(now, self._snapshot())):
            self._propose(cut, detector.silence(now))
        for errand in self._errands_now():
            errand.after_beat(client)
        return True

    def _errands_now(self) -> list[Errand]:
        with self._lock:
            return list(self._errands)

    def _snapshot(self) -> dict[int, int | None]:
        """Every other live rank's counter: one ``multi_get`` (per-key reads if some counter was never made)."""
        ranks = [r for r in range(self._detector.world_size) if r != self.rank and r not in self._detector.dead]
        keys = [heartbeat_key(r) for r in ranks]
        if check(self._client, keys):
            values = [int(v) for v in self._client.multi_get(keys)]
            return dict(zip(ranks, values, strict=True))
        beats = {}
        for r, key in zip(ranks, keys, strict=True):
            value = read(self._client, key)
            beats[r] = None if value is None else int(value)
        return beats

    def _learn(self, counted: int, heard: int, now: float) -> None:
        """Read the cuts posted since the last beat, adopt them, and tell the errands (the scheduler wakes its waiters).

        ``counted`` is the group's cut counter, ``heard`` the highest cut whose key the listener saw written: its
        poster moves the counter right after, and this rank does it in its stead (one ``compare_set``, once).
        """
        while len(self._cuts) < max(counted, heard):
            index = len(self._cuts) + 1
            if index > counted:
                self._client.compare_set(CUTS_KEY, str(index - 1), str(index))
            self._adopt(Cut.decode(index, bytes(self._client.get(cut_key(index)))), now)

    def _propose(self, ranks: tuple[int, ...], silent: float) -> None:
        """Post ``ranks`` as the next cut; adopt whatever cut of that number came first, then propose the rest."""
        remaining = set(ranks)
        while remaining:
            index = len(self._cuts) + 1
            mine = Cut(index, tuple(sorted(remaining)), self.rank, round(silent, 3))  # as it reads back
            if put_once(self._client, cut_key(index), mine.encode()):
                cut = mine
            else:
                cut = Cut.decode(index, bytes(self._client.get(cut_key(index))))
            # Whoever posted or read cut i moves the counter on, so that a proposer dead in between loses nothing.
            self._client.compare_set(CUTS_KEY, str(index - 1), str(index))
            self._adopt(cut, self._clock())
            remaining -= set(cut.ranks)
            remaining -= self._detector.dead

    def _adopt(self, cut: Cut, now: float) -> None:
        self._detector.adopt(cut.ranks, now)
        with self._lock:
            self._cuts.append(cut)
        for errand in self._errands_now():  # after the cut is listed: a waiter that looked before is woken
            errand.on_cut(self._client)

    def _start_watching(self) -> None:
        """Start the keeper and the cut listener, where the store's wire address is known and proven.

        With torch's own prefixed store, rank 0 publishes the prefix as its group forms, as the others look for
        it: they look again after 0.1 s, then after twice as long each time (at most a beat), :data:`_WATCH_TRIES`
        times in all (one read each).
        """
        if time.monotonic() < self._next_try:
            return
        self._tries += 1
        try:
            done = self._start_keeper_and_listener(last=self._tries >= _WATCH_TRIES)
        except BaseException:
            done = True
            raise
        finally:
            if done:
                self._watching = False
                self._keeper_starting = True
                self._keeper_started()
        if not done:
            self._next_try = time.monotonic() + min(self._every, 0.1 * 2 ** (self._tries - 1))

    def _keeper_started(self) -> bool:
        """Whether the keeper watches this rank now (or never will); until then ``wait_watching`` waits for it."""
        if self._keeper is not None and not self._keeper.ready():
            return False
        self._keeper_starting = False
        self._watched.set()
        return True

    def _start_keeper_and_listener(self, last: bool) -> bool:
        """Start them if the address is known; False: not known yet, ask again later."""
        address, wire, why = proven_wire(self._client, self.rank)
        if why == NOT_YET and not last:
            return False
        if address is None or wire is None:  # detection by silence alone
            _log.info(
                "ignite_ext: rank %d: a dead rank is noticed by its silent heartbeat only, within about 4/3 of "
                "IGNITE_EXT_HEARTBEAT_TIMEOUT, not at the moment its process ends: %s",
                self.rank,
                why,
            )
            return True
        proof = read(self._client, CUTS_KEY)
        try:
            self._listener = CutListener(address, proof or b"", len(self._cuts) + 1, self._on_cut, wire)
        except (OSError, ValueError):
            wire.close()
            return True  # not proven: detection by silence alone
        identity = process_identity(os.getpid())
        if identity is None or not hasattr(os, "pidfd_open"):
            return True  # no /proc or no pidfd (not Linux 5.3+): no keeper; the listener still hears each cut at once
        put(self._client, proc_key(self.rank), identity.encode())
        try:
            self._keeper = KeeperHandle(address, self.rank, self._detector.world_size, self._every, identity)
        except OSError as exc:  # no interpreter to start (an embedding application): detection by silence alone
            _log.debug("ignite_ext: no keeper for rank %d: %s", self.rank, exc)
        return True

    def _on_cut(self, index: int) -> None:
        self._heard = max(self._heard, index)
        self._urgent.set()
        self._wake.set()

    def _end_watching(self) -> None:
        """Say goodbye to the keeper and end the listener (a normal end: the rank is not declared for it)."""
        if not self._ended.acquire(blocking=False):
            return
        if self._keeper is not None:
            self._keeper.stop()
        if self._listener is not None:
            self._listener.close()

    def _fire_errands(self) -> float:
        """Run what the errands have due; return the seconds until the next is due."""
        with self._lock:
            self._sleeps_until = math.inf  # until the thread has chosen its sleep, every wake_by wakes it
        now = time.monotonic()
        upcoming = min((errand.fire(self._client) for errand in self._errands_now()), default=math.inf)
        return max(0.0, min(upcoming, now + 3600.0) - now)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Leaving (interpreter exit, the process group destroyed): rank 0 may wait for it at its own exit.
            for errand in self._errands_now():
                with contextlib.suppress(RuntimeError, OSError):
                    errand.end(self._client)
            self._end_watching()

    def _loop(self) -> None:
        next_beat = time.monotonic() + self._every
        while True:
            try:
                until_tick = self._fire_errands()
                if self._watching:
                    self._start_watching()
                    until_tick = min(until_tick, max(0.0, self._next_try - time.monotonic()))
                if self._keeper_starting and not self._keeper_started():
                    until_tick = min(until_tick, _KEEPER_LOOK)  # a local pipe, read until the keeper says it runs
                wait = min(until_tick, max(0.0, next_beat - time.monotonic()))
                with self._lock:
                    self._sleeps_until = time.monotonic() + wait
                self._wake.wait(wait)
                self._wake.clear()
                if _STOPPING.is_set():
                    return
                if time.monotonic() >= next_beat or self._urgent.is_set():
                    self._urgent.clear()
                    if not self._armed(self._beat):
                        return
                    if self._keeper is not None:
                        self._keeper.beat()
                    self._follow()
                    next_beat = time.monotonic() + self._every
            except (RuntimeError, OSError):  # torch's store errors are RuntimeErrors; a bug is not caught here
                return  # the store is gone (process group destroyed or its host died): nothing left to beat

    def _follow(self) -> None:
        with self._following:
            with self._lock:
                followers = list(self._followers)
            for follower in followers:

                def run(follower: Callable[[Store], None] = follower) -> bool:
                    follower(self._client)
                    return True

                self._armed(run)

    def _armed(self, beat: Callable[[], bool]) -> bool:
        """Run ``beat``, armed on the watchdog while a waiter waits (outside blocks a slow store is not ours to cut)."""
        if self._port is None or not any(e.busy() for e in self._errands_now()) or not watchdog_enabled():
            return beat()
        dog = watchdog()
        token = dog.arm(time.monotonic() + heartbeat_timeout(), self._port)
        try:
            return beat()
        finally:
            dog.disarm(token)


#: How often a rank other than 0 looks for the wire prefix rank 0 publishes, before it does without a keeper.
_WATCH_TRIES = 16
#: Seconds between two looks at a starting keeper's pipe (only while it starts: 20 ms to seconds, once per process).
_KEEPER_LOOK = 0.02
_STOPPING = threading.Event()
_RUNNING: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def _stop_at_exit(heartbeat: Heartbeat) -> None:
    if not _RUNNING:
        atexit.register(_stop_beating)
    _RUNNING.add(heartbeat)


def _stop_beating() -> None:
    """At interpreter exit, end the beat threads before the interpreter freezes its daemon threads.

    A daemon thread frozen inside a store call (the store's host gone at the same moment, as when rank 0 exits
    first) can abort the process ("terminate called without an active exception") as its C++ frames unwind; a
    thread that has returned cannot. Each is woken and given at most a second to finish its beat.
    """
    _STOPPING.set()
    for heartbeat in list(_RUNNING):
        heartbeat._wake.set()
        if heartbeat._thread is not None:
            heartbeat._thread.join(timeout=1.0)
        heartbeat._end_watching()


_WATCHING = threading.Event()


def watch_for_groups() -> bool:
    """Beat from the moment a process group exists, not from the first block; True when watching starts.

    A rank that dies before its first scheduled block has then been watched since its group formed, so the ranks
    waiting at that block's entry declare it dead instead of waiting for it forever. A daemon thread looks for a
    new default process group in this process only (no store request), five times a second for the first minute
    and once a second after that; once one exists, the rank beats as it would from its first block. A forked
    child watches too, unless it was forked with a process group already (a DataLoader worker: a copy, not a
    rank). ``IGNITE_EXT_EARLY_HEARTBEAT=0`` turns this off, so that beats start with the first block.

    Examples:
        >>> import os
        >>> from ignite_ext.distributed.liveness import watch_for_groups
        >>> os.environ["IGNITE_EXT_EARLY_HEARTBEAT"] = "0"
        >>> watch_for_groups()
        False
        >>> del os.environ["IGNITE_EXT_EARLY_HEARTBEAT"]

    .. versionadded:: 0.2.0
    """
    if not early_heartbeat():
        return False
    if not _WATCHING.is_set():
        _WATCHING.set()
        threading.Thread(target=_watch, name="ignite_ext-group-watch", daemon=True).start()
        os.register_at_fork(after_in_child=_after_fork)
    return True


def _after_fork() -> None:
    global _WATCHING
    # The thread did not come along; a new event, as the old one's lock may have been held at the fork.
    _WATCHING = threading.Event()
    if group_store() is None:  # the store's lock is new in the child too (store.clients)
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
