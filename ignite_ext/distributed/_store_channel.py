"""The store channel: waits through the process group's store, heartbeats, and dead ranks declared exactly once.

See :mod:`ignite_ext.distributed._channel` for the protocol and :mod:`ignite_ext.distributed._store` for the keys.

**No polling.** A waiting rank blocks in one server-side ``store.wait`` on its own wake key
(``.../wake/<rank>``). Whoever completes what it waits for sets that key: the rank whose ``add`` makes every rank
entered (rank 0's key), rank 0 posting the verdict (every other rank's keys, one ``multi_set``), a rank posting
its outcome (the keys of the ranks whose turn comes after it), the rank whose exit makes every rank left (every
key). Its own heartbeat thread sets it too, once a slice (the log interval, with jitter) is over, so that the
waiter checks its timeout and logs, and at once when the ring successor has fallen silent. A waiter always reads
its condition after deleting its wake key, so no wake-up is ever lost. A wait therefore costs three requests per
slice whatever its length, and a waiter is told within a fraction of a millisecond.

**Liveness.** Every process beats ``ignite_ext/hb/<rank>`` from a daemon thread on its own store client (a blocked
``wait`` holds its client's lock), every sixth of the heartbeat timeout ``T``, from the moment its process group
exists (:func:`~ignite_ext.distributed._heartbeat.watch_for_groups`). A beat writes ``<count>|<count of the
successor>``: the beat number, and the beat number of rank ``rank + 1`` as last seen. So the heartbeat thread
reads the ring successor's beat anyway, and a waiter uses that view (:meth:`Heartbeat.view_of`) with no request
of its own; past a successor declared dead it reads the next rank's beat itself, once a slice (then ``T/3``).
``T`` seconds without a change and the successor is declared dead, exactly once (``compare_set`` of its
outcome), and so is every rank after it that beat at most twice after the dead rank last saw it (alive, it would
have beaten about six times since), at once, in one pass, each outcome naming all of them: a lost node's ranks are
all reported within ``T`` plus two beats (``4/3 T``), not one timeout each. A rank found dead after posting its
outcome is declared too (see :meth:`StoreChannel._lost_leaving`); whoever declares a dead rank wakes the ranks
waiting for it, since it may have died before it could. A rank is only mistaken for dead when its beat thread
cannot run for ``5/6 T`` (25 s at the default): CPython hands the GIL to another thread every 5 ms unless a C
extension holds it that long. A rank that never beat (its process group is not up yet) cannot be told dead from
late, and is not declared.

**A silent store.** Each step (entry, wait, leave) is armed on the process's watchdog (:meth:`StoreChannel._step`,
:mod:`ignite_ext.distributed._steps`), which shuts down the connections to the store when a request is ``T``
overdue or ``timeout=`` is over: a request to a paused or cut-off host would otherwise block until TCP gives up.
While a rank waits, its heartbeat thread's beats are armed as well, so that a silent store is found within a beat
and ``T`` although a slice is long.

**Cost** per rank and block, nothing failing: about 12 requests plus 3 per slice waited (see the scheduling
guide); per beat 2 requests; rank 0 additionally reads the N entries (one ``multi_get``) and wakes the others (one
``multi_set``).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TypeVar

import torch.distributed

from ignite_ext.distributed._channel import (
    Channel,
    decode_failures,
    encode_failures,
    heartbeat_timeout,
    log,
    log_interval,
)
from ignite_ext.distributed._heartbeat import (
    Heartbeat,
    Lingering,
    Watch,
    client_of_this_thread,
    forget_client_of_this_thread,
    slice_seconds,
    stopped_with,
)
from ignite_ext.distributed._state import GroupState
from ignite_ext.distributed._steps import store_port, watchdog, watchdog_enabled
from ignite_ext.distributed._store import BlockKeys, Store, heartbeat_key, put, put_once, read
from ignite_ext.distributed.policies import Plan
from ignite_ext.errors import RankDiedError, RankFailedError, RankFailure, StoreLostError

__all__ = ["StoreChannel"]

T = TypeVar("T")

# The exc_type of a dead rank's failure: the error it raises itself if it is still alive to learn of it.
_DIED = RankDiedError.__name__
# A verdict that is not the judge's but a death at the entry: every rank raises it.
_DEATH_VERDICT = b"D\n"
# Added to ``exits`` for each rank found dead after posting its outcome: it may never have counted its exit.
# Below it, ``exits`` counts as the StoreChannel docstring says (at most N * (N + 2), far below 2**32).
_LOST = 1 << 32
# Added once, after a loss, by the rank that finds every outcome posted: the block is over.
_COMPLETE = 1 << 52
# Added to ``entered`` by whoever posts a death at the entry as the verdict: far above any count of ranks.
_DEATH_ENTERED = 1 << 32
# With timeout=, how long past it a protocol step may still take before the store counts as unreachable.
_STORE_GRACE_S = 2.0


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
        self.seq = seq
        self.state = state
        self.heartbeat = self._guarded(lambda: Heartbeat.ensure(store, rank, world_size))
        # Blocking waits hold a client's lock: this thread's own client, so other threads' store calls never wait.
        self.client = self._guarded(lambda: client_of_this_thread(store))
        self.dead: set[int] = set()  # ranks this rank knows died in this block
        self._watches: dict[int, Watch] = {}  # successors whose beats this rank reads itself (past dead ranks)
        self._reads_successor = False
        self._dependents: list[list[int]] = [[] for _ in range(world_size)]
        self._started = time.monotonic()
        self._port = store_port(self.client)  # None: not a TCPStore, nothing to watch (see _step)
        self._token: int | None = None  # the step under way, on the watchdog
        self._ends_at = float("inf")

    def start(self, plan: Plan) -> None:
        super().start(plan)
        for r, turn in enumerate(plan.turns):
            for peer in turn.after:
                self._dependents[peer].append(r)

    # --- waking and waiting ------------------------------------------------------------------------------------

    def _wake(self, ranks: Iterable[int]) -> None:
        keys = [self.keys.wake(r) for r in ranks if r != self.rank]
        if keys:  # one request for all of them (torch's stub does not list multi_set; every c10d store has it)
            self.client.multi_set(keys, ["w"] * len(keys))  # type: ignore[attr-defined]

    def _wake_all(self) -> None:
        self._wake(range(self.world_size))

    def _bounded(self) -> float | None:
        """Seconds left of ``timeout``."""
        if self.timeout is None:
            return None
        return self.timeout - (time.monotonic() - self._started)

    def _step(self, step: Callable[[], T]) -> T:
        """Run one step of the protocol; give up on a store that stops answering.

        A TCPStore client request to a paused or cut-off host blocks until TCP gives up (about 15 minutes), its
        own timeout only bounding waits for keys. So each step is armed on this process's watchdog
        (:mod:`ignite_ext.distributed._steps`): a request :func:`heartbeat_timeout` overdue (a store that silent is
        as lost as a rank that silent) or, with ``timeout=``, still unanswered when the timeout plus
        :data:`_STORE_GRACE_S` is over, has its connection shut down, and the step raises ``StoreLostError``.
        ``IGNITE_EXT_STORE_WATCHDOG=0`` turns the watchdog off (a silent store then blocks until TCP gives up).
        """
        if self._port is None or not watchdog_enabled():
            return self._guarded(step)
        now = time.monotonic()
        # A step begun after the timeout (a first rank leaving after working longer) still gets the grace.
        self._ends_at = (
            float("inf") if self.timeout is None else max(now, self._started + self.timeout) + _STORE_GRACE_S
        )
        dog = watchdog()
        self._token = dog.arm(min(now + heartbeat_timeout(), self._ends_at), self._port)
        try:
            value = self._guarded(step)
        except StoreLostError as exc:
            if not dog.disarm(self._token):
                raise
            forget_client_of_this_thread(self.store)
            raise StoreLostError(
                f"no answer for {time.monotonic() - now:.0f} s",
                f"rank {self.rank} waiting ({self.label}); the store did not answer: its host is paused or unreachable",
            ) from exc
        except BaseException:
            dog.disarm(self._token)
            raise
        if dog.disarm(self._token):  # it answered just as its connections were shut down: they are gone all the same
            forget_client_of_this_thread(self.store)
        return value

    def _expect_answer_within(self, seconds: float) -> None:
        """The request about to be sent may take ``seconds`` (a wait): move the step's deadline accordingly."""
        if self._token is not None:
            watchdog().extend(self._token, min(time.monotonic() + seconds + heartbeat_timeout(), self._ends_at))

    def _wait(self, ready: Callable[[], T | None], what: str, checked: bool = False, known: T | None = None) -> T:
        """Block until ``ready`` returns a value; one store wait per slice; liveness between slices; time out.

        ``checked``: the caller has just learnt what ``ready`` would return, ``known`` (no request then).
        """
        value = known if checked else ready()
        if value is not None:
            return value
        start = logged = time.monotonic()
        wake = self.keys.wake(self.rank)
        declared = self._check_successor()  # a first look at once
        while True:
            if declared and (value := ready()) is not None:  # what this rank posted may be what it waits for
                return value
            now = time.monotonic()
            left = self._bounded()
            if left is not None and left <= 0:
                raise TimeoutError(f"rank {self.rank} waited {now - start:.0f} s for {what} ({self.label})")
            if now - logged >= 0.9 * log_interval():  # at a slice's end, about once a log interval
                log().info("rank %d has waited %.0f s for %s (%s)", self.rank, now - start, what, self.label)
                logged = now
            seconds = slice_seconds(heartbeat_watches=not self._reads_successor)
            if left is not None:
                seconds = max(0.01, min(seconds, left))
            self.heartbeat.tick(wake, seconds)
            wait_s = seconds + max(5.0, seconds)
            self._expect_answer_within(wait_s)
            try:
                self.client.wait([wake], timedelta(seconds=wait_s))
            except torch.distributed.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise
                # The tick did not come (the heartbeat thread is gone): a slice all the same.
            finally:
                self.heartbeat.untick(wake)
            self._expect_answer_within(0.0)
            self.client.delete_key(wake)
            if (value := ready()) is not None:
                return value
            declared = self._check_successor()

    # --- liveness ------------------------------------------------------------------------------------------------

    def _next(self, rank: int) -> int:
        return (rank + 1) % self.world_size

    def _check_successor(self) -> bool:
        """Look at the ring successor's beat; declare it, and the dead run of ranks after it, dead after ``T``.

        Returns:
            Whether it found ranks dead.
        """
        succ = self._next(self.rank)
        while succ in self.dead and succ != self.rank:
            succ = self._next(succ)
        if succ == self.rank:
            return False
        # The heartbeat thread reads the successor's beat at each beat anyway, and wakes the waiters when it falls
        # silent: no request. Past a dead rank (or with the thread behind), read it, once a slice.
        view = self.heartbeat.view_of(succ)
        self._reads_successor = view is None
        if view is None:
            if succ not in self._watches:
                self._watches[succ] = self.heartbeat.watch_of(succ)
            watch = self._watches[succ]
            beat = read(self.client, heartbeat_key(succ))
            silent = watch.observe(beat, time.monotonic())
        else:
            beat, silent = view
        if beat is None or silent <= heartbeat_timeout():
            return False  # alive, or never beat (not started yet: cannot be told from late)
        victims, last = [succ], beat
        nxt = self._next(succ)
        while nxt != self.rank and nxt not in self.dead:
            # The dead rank's last beat says how far its successor had beaten. Alive, the successor would have beaten
            # about 6 times since (the dead rank has been silent for T); at most twice more (ranks of a lost node
            # die within a beat or two of each other on a loaded host), it died with it.
            now_beat = read(self.client, heartbeat_key(nxt))
            if now_beat is None or not stopped_with(now_beat, last):
                break
            victims.append(nxt)
            last, nxt = now_beat, self._next(nxt)
        # The noticing rank is part of each message so that two ranks declaring the same death write different
        # payloads, and compare_set tells exactly one of them that it won.
        failures = [
            RankFailure(
                v, _DIED, f"no heartbeat for {silent:.0f} s, noticed by rank {self.rank} (killed or hung)", True
            )
            for v in victims
        ]
        if not self.plan.turns:  # still at the entry: nobody has run anything, so everyone just stops
            if put_once(self.client, self.keys.verdict, _DEATH_VERDICT + encode_failures(failures)):
                log().warning(
                    "rank %d: declaring ranks %s dead at the entry (%s)", self.rank, victims, failures[0].message
                )
                self.dead.update(victims)
                self.client.add(self.keys.entered, _DEATH_ENTERED)  # rank 0's one read then tells it
                self._wake_all()
            # Else a verdict came first (rank 0 may have died after posting it, before waking anyone): this rank
            # reads it, and declares the dead ranks in the plan's waits, where their outcomes are posted.
            return True
        self.dead.update(victims)
        for failure in failures:
            self._declare_dead(failure, failures, silent)
        return True

    def _declare_dead(self, failure: RankFailure, together: list[RankFailure], silent_for: float) -> None:
        """Post ``failure.rank``'s outcome as its death; those waiting for it learn of all who died ``together``."""
        peer = failure.rank
        if put_once(self.client, self.keys.outcome(peer), encode_failures(together)):
            log().warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
            self._record_exit([failure])
            self._wake(self._dependents[peer])
            if peer != 0:
                self._ack()
            return
        posted = decode_failures(self.client.get(self.keys.outcome(peer)))
        if not any(f.rank == peer and f.died for f in posted):
            self._lost_leaving(peer, silent_for)

    def _lost_leaving(self, peer: int, silent_for: float) -> None:
        """``peer`` died after posting its outcome: maybe before counting its exit, which everyone waits for.

        Nobody can tell whether that count happened, so its failure is recorded without an exit and ``exits``
        gets :data:`_LOST`. From then on, whoever finds every outcome posted (this rank now, or each rank as it
        counts its own exit) ends the block for all: ``exits`` gets :data:`_COMPLETE` once. The rank whose
        exit is the last one to come always finds that, since every rank posts its outcome before counting.
        """
        client, keys = self.client, self.keys
        if not put_once(client, keys.lost(peer), b"1"):
            return  # another rank found it first
        failure = RankFailure(
            peer,
            _DIED,
            f"no heartbeat for {silent_for:.0f} s after it finished its block, noticed by rank {self.rank} "
            "(killed or hung while leaving)",
            died=True,
        )
        log().warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
        self._wake(self._dependents[peer])  # it may have died before waking them: they wait for its outcome
        index = client.add(keys.nfail, 1)
        put(client, keys.fail(index), encode_failures([failure]))
        self.state.carried.setdefault(self.seq, []).extend([keys.fail(index), keys.lost(peer)])
        client.add(keys.exits, _LOST)
        if peer != 0:
            self._ack()
        self._complete_if_over()

    def _complete_if_over(self) -> bool:
        """After a loss: end the block for everyone if every rank has posted its outcome (one O(N) check).

        A failing rank's record may still be on its way when that is found, so the failures of every outcome go
        into ``complete`` (one O(N) read, by the rank that finds the block over): the others read that one key.
        """
        outcomes = [self.keys.outcome(r) for r in range(self.world_size)]
        if not self.client.check(outcomes):
            return False
        failures = {f for outcome in self.client.multi_get(outcomes) for f in decode_failures(bytes(outcome))}
        if put_once(self.client, self.keys.complete, encode_failures(sorted(failures, key=lambda f: f.rank))):
            self.client.add(self.keys.exits, _COMPLETE)
            self._wake_all()  # every rank but this one, which must know without a wake-up: see _record_exit
            return True
        return False

    # --- the protocol --------------------------------------------------------------------------------------------

    def _forget(self, mark: int) -> None:
        # Every rank has left every block below ``mark`` (the verdict's lowest low-water mark): nobody reads
        # their keys any more.
        Lingering.release(self.store)
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
        verdict = self._step(lambda: self._exchange(marked, judge_marked))
        if verdict.startswith(_DEATH_VERDICT):
            raise RankFailedError(
                decode_failures(verdict[len(_DEATH_VERDICT) :]), f"rank {self.rank} waiting at the entry ({self.label})"
            )
        mark, verdict = verdict.split(b"\n", 1)
        self._forget(int(mark))
        return verdict

    def _exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        client, keys = self.client, self.keys
        put(client, keys.entry(self.rank), mine)
        entered = int(client.add(keys.entered, 1))
        if entered == self.world_size and self.rank != 0:
            self._wake([0])
        if self.rank != 0:
            return self._wait(lambda: read(client, keys.verdict), "rank 0 to check the arguments")

        def entered_or_dead(entered: int) -> bytes | None:
            if entered >= _DEATH_ENTERED:  # a death at the entry, posted as the verdict by whoever noticed it
                return bytes(client.get(keys.verdict))
            return b"" if entered >= self.world_size else None

        posted = self._wait(
            lambda: entered_or_dead(int(client.add(keys.entered, 0))),
            "every rank to enter",
            checked=True,
            known=entered_or_dead(entered),
        )
        if posted:
            return posted
        verdict = judge([bytes(v) for v in client.multi_get([keys.entry(r) for r in range(self.world_size)])])
        if not put_once(client, keys.verdict, verdict):
            return bytes(client.get(keys.verdict))  # a death was posted meanwhile: it wins
        self._wake_all()
        return verdict

    def _record_exit(self, own: list[RankFailure]) -> int:
        """Count this exit (and post ``own`` failures); return ``exits`` as it now is."""
        client, keys = self.client, self.keys
        if own:
            index = client.add(keys.nfail, 1)
            put(client, keys.fail(index), encode_failures(own))
            self.state.carried.setdefault(self.seq, []).append(keys.fail(index))
        exits = int(client.add(keys.exits, 1 + (self.world_size + 1) * bool(own)))
        if exits % _LOST % (self.world_size + 1) == self.world_size:
            self._wake_all()  # every rank has left: the ones waiting in leave go on
        elif _LOST <= exits < _COMPLETE and self._complete_if_over():
            exits += _COMPLETE  # this rank ended the block: its own wait must not wait for a wake-up of itself
        return exits

    def _ack(self) -> None:
        # At least: a rank lost while leaving may have acked before it died, and then been acked for.
        if self.client.add(self.keys.acks, 1) >= self.world_size - 1:
            put(self.client, self.keys.acked, b"1")

    def wait_turn(self) -> list[RankFailure]:
        return self._step(self._wait_turn)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        return self._step(lambda: self._leave(own, inherited, linger))

    def _wait_turn(self) -> list[RankFailure]:
        inherited: list[RankFailure] = []
        for peer in sorted(self.plan.turns[self.rank].after):
            key = self.keys.outcome(peer)
            outcome = self._wait(lambda k=key: read(self.client, k), f"rank {peer}")  # type: ignore[misc]
            inherited += decode_failures(outcome)
        return sorted(set(inherited), key=lambda f: f.rank)

    def _leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool) -> list[RankFailure]:
        if not put_once(self.client, self.keys.outcome(self.rank), encode_failures(own or inherited)):
            raise RankDiedError(
                [RankFailure(self.rank, _DIED, "declared dead by its peers after its heartbeat stopped", died=True)],
                f"rank {self.rank}",
            )
        exits = self._record_exit(own)
        self._wake(self._dependents[self.rank])
        found = own + inherited
        if not found:
            exits = self._wait(
                lambda: self._left(int(self.client.add(self.keys.exits, 0))),
                "every rank to finish",
                checked=True,
                known=self._left(exits),
            )
            if exits >= _COMPLETE:  # ended after a loss: every outcome's failures are in one key
                found += decode_failures(self.client.get(self.keys.complete))
            # After a loss, its ranks' records count no exit in ``exits``: the record counter says how many there are.
            records = int(self.client.add(self.keys.nfail, 0)) if exits >= _LOST else exits // (self.world_size + 1)
            for i in range(1, records + 1):
                found += decode_failures(self.client.get(self.keys.fail(i)))
            found = list(set(found))
        if self.rank != 0:
            self._ack()
        elif linger:
            Lingering.hold(self.store, self.keys, self.world_size - 1)
        return sorted(found, key=lambda f: f.rank)

    def _left(self, exits: int) -> int | None:
        """``exits`` when it says every rank has left (or the block was ended after a loss), else None."""
        return exits if exits >= _COMPLETE or exits % _LOST % (self.world_size + 1) == self.world_size else None

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (TimeoutError, RankFailedError):
            raise
        except RuntimeError as exc:  # DistStoreError and friends: the store itself is unreachable
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise StoreLostError(
                cause,
                f"rank {self.rank} waiting ({self.label}); the store did not answer: the process hosting it (rank "
                "0's under env://, node 0's agent under torchrun) has exited, or its host is paused or unreachable",
            ) from exc
