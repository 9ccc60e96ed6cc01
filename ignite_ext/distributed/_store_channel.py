"""The store channel's block protocol: entries judged by the last, turns, exits, dead ranks declared exactly once.

See :mod:`ignite_ext.distributed._channel` for the protocol, :mod:`ignite_ext.distributed.store.keys` for the keys
and :mod:`ignite_ext.distributed._store_waiting` for how a rank waits (one server-side wait per slice on its wake
key, each step armed on the watchdog).

**No polling.** A waiting rank blocks on its own wake key for the phase of the block it is in
(``.../wake/<rank>/<phase>``: the verdict, its turn, every exit). Whoever completes what it waits for sets that
key: the rank whose ``add`` makes every rank entered, as it posts the verdict (every other rank's keys, one
``multi_set``), a rank posting its outcome (the keys of the ranks whose turn comes after it), the rank whose exit
makes every rank left (every key). A waiter is told within a fraction of a millisecond.

**Liveness.** Which ranks are dead is decided by :mod:`ignite_ext.distributed.liveness`, once for the group: a
*cut*, the same set on every rank, within ``4/3 T`` of the deaths whatever their number and pattern. A waiter woken
by a new cut declares its ranks dead in its block (:meth:`StoreChannel._declare_cuts`, no request but those of the
declaring): at the entry, the verdict says so and every rank raises; in the plan, each dead rank's outcome is
posted as its death (``compare_set``: exactly one rank counts its exit), naming the whole cut, and its dependents
are woken. A rank found dead after posting its outcome is declared too (see :meth:`StoreChannel._lost_leaving`).
A rank that finds itself in a cut (it was paused or cut off for longer than ``T``) raises ``RankDiedError`` at its
next step: the others have given up on it.

**Off the path.** A block's keys are deleted, and a rank's acknowledgement of its outcome sent, by the rank's
heartbeat thread (:mod:`ignite_ext.distributed._chores`), once every rank has left it.

**Cost** per rank and block, nothing failing: about 11 requests plus 4 per slice waited (see the scheduling
guide); per beat 2 requests; the last rank to enter additionally reads the N entries (one ``multi_get``, or a read
each of the others' with at most three ranks), judges them and wakes the others (one ``multi_set``): nobody relays
the entries to a fixed judge.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from ignite_ext.distributed._channel import Channel, decode_failures, encode_failures, log
from ignite_ext.distributed._chores import Chores
from ignite_ext.distributed._lingering import Lingering
from ignite_ext.distributed._state import GroupState
from ignite_ext.distributed._store_waiting import StoreWaiter, guarded
from ignite_ext.distributed.liveness import Cut, Heartbeat, beat_interval, heartbeat_timeout
from ignite_ext.distributed.policies import Plan
from ignite_ext.distributed.store.clients import Store, ack, check, client_of_this_thread, put, put_once, read
from ignite_ext.distributed.store.codecs import COMPLETE, DEATH_ENTERED, LOST, ExitCount, decode_progress
from ignite_ext.distributed.store.keys import BlockKeys
from ignite_ext.errors import RankDiedError, RankFailedError, RankFailure, RankStalledError
from ignite_ext.progress import Progress

__all__ = ["StoreChannel"]

T = TypeVar("T")

# The exc_type of a dead rank's failure: the error it raises itself if it is still alive to learn of it.
_DIED = RankDiedError.__name__
# A verdict that is not the judge's but a death at the entry: every rank raises it.
_DEATH_VERDICT = b"D\n"


def _failures_of(cuts: list[Cut]) -> list[RankFailure]:
    """Each rank of ``cuts`` as a death, with its cut's message (the same bytes on every rank)."""
    return [RankFailure(r, _DIED, cut.message(), died=True) for cut in cuts for r in cut.ranks]


def _one_per_rank(failures: list[RankFailure]) -> list[RankFailure]:
    """One failure per rank, sorted by rank (a rank's death may reach this rank by two ways, worded apart)."""
    return sorted({f.rank: f for f in reversed(failures)}.values(), key=lambda f: f.rank)


def _ranks(cuts: list[Cut]) -> list[int]:
    return sorted(r for cut in cuts for r in cut.ranks)


class StoreChannel(Channel):
    """Waits through the process group's store; see the module docstring.

    Its keys are those of :class:`~ignite_ext.distributed.store.keys.BlockKeys`: ``out/<rank>`` holds a rank's
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
        self.exit_count = ExitCount(world_size)
        self.seq = seq
        self.state = state
        self.heartbeat = guarded(lambda: Heartbeat.ensure(store, rank, world_size), rank, label)
        self.chores = Chores.of(self.heartbeat)
        # Blocking waits hold a client's lock: this thread's own client, so other threads' store calls never wait.
        self.client = guarded(lambda: client_of_this_thread(store), rank, label)
        self.dead: set[int] = set()  # ranks this rank knows died in this block
        self._cuts_seen = 0  # the group's cuts this rank has declared in this block
        self._dependents: list[list[int]] = [[] for _ in range(world_size)]
        self.waiter = StoreWaiter(rank, label, timeout, store, self.client, self.keys, self.chores)

    def start(self, plan: Plan) -> None:
        super().start(plan)
        for r, turn in enumerate(plan.turns):
            for peer in turn.after:
                self._dependents[peer].append(r)

    # --- waking and waiting ------------------------------------------------------------------------------------

    def _step(self, step: Callable[[], T]) -> T:
        return self.waiter.step(step)

    def _wait(
        self,
        ready: Callable[[], T | None],
        what: str,
        phase: str,
        checked: bool = False,
        known: T | None = None,
        about: Callable[[], str] | None = None,
    ) -> T:
        return self.waiter.wait(ready, what, phase, self._declare_cuts, checked, known, about)

    def _wake(self, ranks: Iterable[int], phase: str) -> None:
        keys = [self.keys.wake(r, phase) for r in ranks if r != self.rank]
        if keys:  # one request for all of them (torch's stub does not list multi_set; every c10d store has it)
            self.client.multi_set(keys, ["w"] * len(keys))  # type: ignore[attr-defined]

    def _wake_all(self, phase: str) -> None:
        self._wake(range(self.world_size), phase)

    # --- liveness ------------------------------------------------------------------------------------------------

    def _declared_dead(self) -> RankDiedError:
        return RankDiedError(
            [RankFailure(self.rank, _DIED, "declared dead by its peers after its heartbeat stopped", died=True)],
            f"rank {self.rank} ({self.label})",
        )

    def explain(self, exc: BaseException) -> RankFailedError | None:
        """Wait for the cut that explains a failed collective: a peer that died makes the others' collectives fail.

        Bounded by the detection time (``4/3 T`` from the death, which came before the failure) and a beat; None
        when no rank is found dead by then (the collective failed for another reason).
        """
        return self._step(lambda: self._explain())

    def _explain(self) -> RankFailedError | None:
        ends = time.monotonic() + 4 / 3 * heartbeat_timeout() + beat_interval()
        while True:
            if cuts := self.heartbeat.cuts():
                self._check_not_declared()
                return RankFailedError(_failures_of(cuts), f"rank {self.rank} planning ({self.label})")
            left = ends - time.monotonic()
            if left <= 0:
                return None
            self.waiter.nap(left, lambda: bool(self.heartbeat.cuts()))

    def _unless_declared(self, failures: list[RankFailure]) -> list[RankFailure]:
        """``failures``, unless they name this rank dead: then it raises ``RankDiedError`` (see below).

        A rank stopped for longer than ``T`` may post its outcome before its heartbeat thread, resumed with it,
        learns of the cut that declared it: the others' records then name it among the dead.
        """
        if any(f.rank == self.rank and f.died for f in failures):
            raise self._declared_dead()
        return failures

    def _declared(self) -> set[int]:
        """The ranks declared dead in this group so far."""
        return {rank for cut in self.heartbeat.cuts() for rank in cut.ranks}

    def _check_not_declared(self) -> None:
        if any(self.rank in cut.ranks for cut in self.heartbeat.cuts()):
            raise self._declared_dead()

    def _declare_cuts(self) -> bool:
        """Declare in this block the ranks of the group's cuts this rank has not declared yet (no request if none).

        Returns:
            Whether there were any.

        Raises:
            RankDiedError: this rank is in a cut (it was paused or cut off for longer than the heartbeat timeout):
                the others have given up on it, so it must not carry on.
        """
        cuts = self.heartbeat.cuts()
        if len(cuts) <= self._cuts_seen:
            return False
        if any(self.rank in cut.ranks for cut in cuts):
            raise self._declared_dead()
        if not self.plan.turns:  # still at the entry: nobody has run anything, so everyone just stops
            failures = _failures_of(cuts)
            verdict = _DEATH_VERDICT + encode_failures(failures) + b"\n%d" % self.rank  # the noticer: one winner
            if put_once(self.client, self.keys.verdict, verdict):
                log().warning(
                    "rank %d: ranks %s died before the block began (%s)", self.rank, _ranks(cuts), cuts[0].message()
                )
                self.client.add(self.keys.entered, DEATH_ENTERED)  # so that no late entrant judges in vain
                self._wake_all("entry")
            elif not bytes(self.client.get(self.keys.verdict)).startswith(_DEATH_VERDICT):
                # The last rank to enter judged first (it may have died after posting the verdict, before waking
                # anyone): the dead ranks are declared in the plan's waits, where their outcomes are posted.
                return True
            self._cuts_seen = len(cuts)
            return True
        for cut in cuts[self._cuts_seen :]:
            failures = _failures_of([cut])
            for failure in failures:
                if failure.rank not in self.dead:
                    self.dead.add(failure.rank)
                    self._declare_dead(failure, failures)
        self._cuts_seen = len(cuts)
        return True

    def _declare_dead(self, failure: RankFailure, together: list[RankFailure]) -> None:
        """Post ``failure.rank``'s outcome as its death; those waiting for it learn of all who died ``together``.

        The outcome ends with the declaring rank, so that of several ranks declaring the same death exactly one
        is told by ``compare_set`` that it won.
        """
        peer = failure.rank
        if put_once(self.client, self.keys.outcome(peer), encode_failures(together) + b"\n%d" % self.rank):
            log().warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
            self._record_exit([failure])
            self._wake(self._dependents[peer], "turn")
            if peer != 0:
                self._ack()
            return
        posted = decode_failures(self.client.get(self.keys.outcome(peer)))
        if not any(f.rank == peer and f.died for f in posted):
            self._lost_leaving(failure)

    def _lost_leaving(self, death: RankFailure) -> None:
        """``death.rank`` died after posting its outcome: maybe before counting its exit, which everyone waits for.

        Nobody can tell whether that count happened, so its failure is recorded without an exit and ``exits``
        gets :data:`~ignite_ext.distributed.store.codecs.LOST`. From then on, whoever finds every outcome posted
        (this rank now, or each rank as it counts its own exit) ends the block for all: ``exits`` gets
        :data:`~ignite_ext.distributed.store.codecs.COMPLETE` once. The rank whose
        exit is the last one to come always finds that, since every rank posts its outcome before counting.
        """
        client, keys, peer = self.client, self.keys, death.rank
        if not put_once(client, keys.lost(peer), b"1"):
            return  # another rank found it first
        failure = RankFailure(
            peer,
            _DIED,
            f"{death.message} after it finished its block (killed or hung while leaving)",
            died=True,
        )
        log().warning("rank %d: declaring rank %d dead (%s)", self.rank, peer, failure.message)
        self._wake(self._dependents[peer], "turn")  # it may have died before waking them: they wait for its outcome
        index = client.add(keys.nfail, 1)
        put(client, keys.fail(index), encode_failures([failure]))
        self.state.carried.setdefault(self.seq, []).extend([keys.fail(index), keys.lost(peer)])
        if peer != 0:
            self._ack()
        if self._mark_lost():
            self._complete_if_over()

    def _mark_lost(self) -> bool:
        """Add :data:`~ignite_ext.distributed.store.codecs.LOST` to ``exits``, unless every rank has left; True if so.

        Every exit counted means the dead rank's too: the block is over for everyone, and a loss added now would
        make the ranks that read ``exits`` after it report a failure that those that read it before did not. So the
        check and the addition are one ``compare_set``. (A failure record this rank wrote meanwhile is never read:
        with no loss counted, the ranks read as many records as failed exits.)
        """
        exits = int(self.client.add(self.keys.exits, 0))
        while self._left(exits) is None:
            marked = str(exits + LOST).encode()
            now = bytes(self.client.compare_set(self.keys.exits, str(exits), marked))  # type: ignore[arg-type]
            if now == marked:  # this rank's, or another loss's of the same moment: either way, marked
                return True
            exits = int(now)
        return False

    def _complete_if_over(self) -> bool:
        """After a loss: end the block for everyone if every rank has posted its outcome (one O(N) check).

        A failing rank's record may still be on its way when that is found, so the failures of every outcome go
        into ``complete`` (one O(N) read, by the rank that finds the block over): the others read that one key.
        """
        outcomes = [self.keys.outcome(r) for r in range(self.world_size)]
        if not check(self.client, outcomes):
            return False
        failures = {f for outcome in self.client.multi_get(outcomes) for f in decode_failures(bytes(outcome))}
        if put_once(self.client, self.keys.complete, encode_failures(sorted(failures, key=lambda f: f.rank))):
            self.client.add(self.keys.exits, COMPLETE)
            # Every rank but this one, which must know without a wake-up (see _record_exit); in both phases where
            # a rank may wait, so that none is left behind on a path of failures this one did not foresee.
            self._wake(range(self.world_size), "turn")
            self._wake_all("exit")
            return True
        return False

    # --- the protocol --------------------------------------------------------------------------------------------

    def _forget(self, mark: int) -> None:
        # Every rank has left every block below ``mark`` (the verdict's lowest low-water mark): nobody reads
        # their keys any more.
        Lingering.release(self.store)
        for seq in self.state.forget_below(mark):
            self.chores.delete_later([*BlockKeys(seq).deleted_by(self.rank), *self.state.carried.pop(seq, [])])

    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """The last rank to enter reads every entry from the store, judges, and publishes the verdict: no collective.

        Any rank can judge (``judge`` is the same function of the same entries on every rank), and the last one to
        enter is the first to know that every entry is there: no further hop to a fixed judge. A late rank
        therefore delays the others without running into the process group's timeout. Each entry
        and the verdict carry a low-water mark line ahead of the payload (see :mod:`ignite_ext.distributed._state`).
        """

        def judge_marked(entries: list[bytes]) -> bytes:
            marks, payloads = zip(*(entry.split(b"\n", 1) for entry in entries), strict=True)
            return b"%d\n" % min(int(m) for m in marks) + judge(list(payloads))

        marked = b"%d\n" % self.state.low_water + mine
        # Not before this rank's keeper runs (once per process, a fraction of a second; at most T): a body that
        # holds the GIL from its first line is then beaten for, not declared dead.
        self.heartbeat.wait_watching(heartbeat_timeout())
        verdict = self._step(lambda: self._exchange(marked, judge_marked))
        if verdict.startswith(_DEATH_VERDICT):
            dead = decode_failures(verdict[len(_DEATH_VERDICT) :])
            if any(f.rank == self.rank for f in dead):
                raise self._declared_dead()
            raise RankFailedError(dead, f"rank {self.rank} waiting at the entry ({self.label})")
        mark, verdict = verdict.split(b"\n", 1)
        self._forget(int(mark))
        return verdict

    def _exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        client, keys = self.client, self.keys
        self._check_not_declared()
        # This entry proves that this rank left the block before: an acknowledgement still pending is moot (and
        # sent after this block's verdict, it could recreate a key already deleted).
        self.chores.cancel_ack()
        put(client, keys.entry(self.rank), mine)
        if int(client.add(keys.entered, 1)) != self.world_size:
            # Not posted yet (the last rank to enter has yet to come), or posted and this rank's key set already.
            return self._wait(lambda: read(client, keys.verdict), "every rank to enter", "entry", checked=True)
        verdict = judge(self._entries(mine))
        if not put_once(client, keys.verdict, verdict):
            return bytes(client.get(keys.verdict))  # a death was posted meanwhile: it wins
        self._wake_all("entry")
        return verdict

    def _entries(self, mine: bytes) -> list[bytes]:
        """Every rank's entry, in rank order, as the last rank to enter reads them.

        torch's ``multi_get`` first waits for its keys, a round trip of its own. Each rank sets its entry before
        counting itself, on the same connection, so every entry is there once the count is full: with at most two
        others to read, a read each costs no more, and with one (two ranks) a round trip less.
        """
        keys = [self.keys.entry(r) for r in range(self.world_size)]
        if self.world_size <= 3:
            found = [mine if r == self.rank else read(self.client, key) for r, key in enumerate(keys)]
            if all(entry is not None for entry in found):
                return [entry for entry in found if entry is not None]
        return [bytes(v) for v in self.client.multi_get(keys)]

    def _record_exit(self, own: list[RankFailure]) -> int:
        """Count this exit (and post ``own`` failures); return ``exits`` as it now is."""
        client, keys = self.client, self.keys
        if own:
            index = client.add(keys.nfail, 1)
            put(client, keys.fail(index), encode_failures(own))
            self.state.carried.setdefault(self.seq, []).append(keys.fail(index))
        count = self.exit_count
        exits = int(client.add(keys.exits, count.exit(failed=bool(own))))
        if count.all_counted(exits):
            self._wake_all("exit")  # every rank has left: the ones waiting in leave go on
        elif count.lost(exits) and not count.ended_after_a_loss(exits) and self._complete_if_over():
            exits = count.complete(exits)  # this rank ended the block: its own wait must not wait to wake itself
        return exits

    def _ack(self) -> None:
        """Acknowledge for a dead rank at once (a live rank's own acknowledgement goes through its heartbeat)."""
        ack(self.client, self.keys.acks, self.keys.acked, self.world_size - 1)

    def wait_turn(self) -> list[RankFailure]:
        return self._step(self._wait_turn)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        return self._step(lambda: self._leave(own, inherited, linger))

    def _wait_turn(self) -> list[RankFailure]:
        inherited: list[RankFailure] = []
        for peer in sorted(self.plan.turns[self.rank].after):
            key = self.keys.outcome(peer)
            # No look first: whoever posts the outcome sets the key after it, and mostly it is still to come.
            outcome = self._wait(
                functools.partial(read, self.client, key),
                f"rank {peer}",
                "turn",
                checked=True,
                about=functools.partial(self._progress_of, peer),
            )
            inherited += decode_failures(outcome)
        return self._unless_declared(_one_per_rank(inherited))

    def _progress_of(self, peer: int) -> str:
        """``peer``'s progress as it last published it, for a log line (one read), or nothing."""
        payload = read(self.client, self.keys.progress(peer))
        return "" if payload is None else f"; rank {peer}: {Progress(*decode_progress(payload))}"

    def post_stall(self, client: Store, failure: RankFailure) -> bool:
        """Post this rank's outcome as its stall, from its heartbeat thread (``client``); False if it had one.

        What the rank's leaving would do for a failure: the outcome (``compare_set``, so that a body that ends at
        that moment either posts its own outcome or finds the stall), its dependents woken, its exit counted.
        """
        if not put_once(client, self.keys.outcome(self.rank), encode_failures([failure]) + b"\n%d" % self.rank):
            return False
        log().warning("rank %d: %s (%s)", self.rank, failure.message, self.label)
        stalled = copy.copy(self)  # its waiter stays the main thread's: nothing below waits
        stalled.client = client
        stalled._wake(self._dependents[self.rank], "turn")
        stalled._record_exit([failure])
        return True

    def _leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool) -> list[RankFailure]:
        self._check_not_declared()
        if not put_once(self.client, self.keys.outcome(self.rank), encode_failures(own or inherited)):
            posted = decode_failures(self.client.get(self.keys.outcome(self.rank)))
            if any(f.rank == self.rank and f.exc_type == RankStalledError.__name__ for f in posted):
                raise RankStalledError(posted, f"rank {self.rank} left the block after its stall ({self.label})")
            raise self._declared_dead()
        # The ranks waiting for this outcome first: the exit count below is nobody's to wait for but the last.
        self._wake(self._dependents[self.rank], "turn")
        exits = self._record_exit(own)
        found = own + inherited
        if not found:
            exits = self._wait(
                lambda: self._left(int(self.client.add(self.keys.exits, 0))),
                "every rank to finish",
                "exit",
                checked=True,
                known=self._left(exits),
            )
            if self.exit_count.ended_after_a_loss(exits):  # every outcome's failures are in one key
                found += decode_failures(self.client.get(self.keys.complete))
            # After a loss, its ranks' records count no exit in ``exits``: the record counter says how many there are.
            lost = self.exit_count.lost(exits)
            records = int(self.client.add(self.keys.nfail, 0)) if lost else self.exit_count.records(exits)
            for i in range(1, records + 1):
                found += decode_failures(self.client.get(self.keys.fail(i)))
            found = _one_per_rank(found)
        if self.rank != 0:
            self.chores.ack_later(self.keys.acks, self.keys.acked, self.world_size - 1)
        elif linger:
            Lingering.hold(self.store, self.keys, self.world_size - 1, self._declared)
        return self._unless_declared(_one_per_rank(found))

    def _left(self, exits: int) -> int | None:
        """``exits`` when it says every rank has left (or the block was ended after a loss), else None."""
        return exits if self.exit_count.left(exits) else None
