"""The failure detector's decisions, as a pure state machine: fed what was read and when, it says what to do.

No thread, no store and no clock of its own (etcd-raft's shape): :mod:`~ignite_ext.distributed.liveness.heartbeat`
drives it with real beats, and the tests drive it with made-up ones in virtual time.

**What it decides.** Each rank watches its ring successor (the next rank not known dead) through the successor's
beat counter, read once per beat. When the successor has not beaten for a quarter of the heartbeat timeout ``T``,
the detector *suspects* and asks for a snapshot of every beat (one read of ``N`` counters, on this path only).
When the successor has then been silent for ``T`` and the first snapshot is at least ``3/5 T`` old, it asks for a
second snapshot: every rank whose counter did not move between the two (silent for at least ``3/5 T``, by this
rank's own clock) is in the **cut** it proposes, the successor (silent for ``T``) first among them. A lost host,
switch or rack is one cut, whatever the pattern of its ranks, proposed by every watcher of a dead rank at about
the same moment; :class:`Cut` numbers them, and the first proposal of each number wins (the driver's
``compare_set``), so every survivor adopts the very same set.

**Timing.** A dead rank's watcher reads its counter at most one beat (``T/6``) after its last beat, suspects a
quarter ``T`` after that read, and proposes ``T`` after the last change: the cut is posted within ``7/6 T`` of the
death, and every rank learns it at its next beat (``T/6``): ``4/3 T`` whatever the number of dead ranks and their
pattern. A rank that never beat counts as silent from the moment the watcher started (its process group formed).

.. versionadded:: 0.3.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ignite_ext.distributed.store.codecs import decode_cut, encode_cut

__all__ = ["SUSPECT_AFTER", "TOGETHER_AFTER", "Cut", "Detector"]

#: The successor's silence, as a fraction of ``T``, after which the detector takes its first snapshot.
SUSPECT_AFTER = 0.25
#: The least time between the two snapshots, as a fraction of ``T``: how long the other ranks of a cut (all but the
#: successor) have been silent at least. With reads once a beat (``T/6``), the first snapshot comes two beats after
#: the successor's last change and the second four beats later, when the successor has been silent for ``T``.
TOGETHER_AFTER = 0.6


@dataclass(frozen=True)
class Cut:
    """Ranks declared dead together: number ``index`` of the group's cuts, proposed by ``author``.

    Examples:
        >>> from ignite_ext.distributed.liveness.detector import Cut
        >>> cut = Cut(1, (2, 3), author=1, silent_s=3.2)
        >>> Cut.decode(1, cut.encode()) == cut
        True
        >>> print(cut.message())
        no heartbeat for 3 s (ranks [2, 3] died together), noticed by rank 1: killed, hung or cut off from the network
        >>> print(Cut(2, (5,), author=5, silent_s=0.0).message())
        its process was killed or crashed

    .. versionadded:: 0.3.0
    """

    index: int
    ranks: tuple[int, ...]
    author: int
    silent_s: float

    def encode(self) -> bytes:
        """The cut as stored (:func:`~ignite_ext.distributed.store.codecs.encode_cut`)."""
        return encode_cut(self.author, self.silent_s, self.ranks)

    @classmethod
    def decode(cls, index: int, payload: bytes) -> Cut:
        """The cut number ``index`` from what :meth:`encode` stored."""
        author, silent, ranks = decode_cut(payload)
        return cls(index, ranks, author, silent)

    def message(self) -> str:
        """What every survivor reports of each of the cut's ranks (the same words everywhere).

        A cut whose author is among its ranks was posted by the keeper of the author's host, which saw the
        processes end (see :mod:`~ignite_ext.distributed.liveness.keeper`). The words are a user's: the keeper
        and the cut stay out of them.
        """
        together = f" (ranks {list(self.ranks)} died together)" if len(self.ranks) > 1 else ""
        if self.author in self.ranks:
            return f"its process was killed or crashed{together}"
        return (
            f"no heartbeat for {self.silent_s:.0f} s{together}, noticed by rank {self.author}: "
            "killed, hung or cut off from the network"
        )


class Detector:
    """One rank's failure detector: see the module docstring.

    Args:
        rank: this rank.
        world_size: the number of ranks.
        timeout: the heartbeat timeout ``T`` in seconds.
        now: the time it starts watching (the successor's silence counts from here until it beats).
        unborn_count: whether a rank whose counter is still 0 (it never beat) can be silent; False where ranks
            start beating only at their first block (it cannot be told from one that has not reached a block).

    Examples:
        Rank 0 of 4 watches rank 1; ranks 1 and 2 stop beating at t = 0.

        >>> from ignite_ext.distributed.liveness.detector import Detector
        >>> d = Detector(0, 4, timeout=6.0, now=0.0)
        >>> d.successor(), d.observe(0.0, 5), d.observe(1.0, 5)
        (1, False, False)
        >>> d.observe(2.0, 5)  # silent for more than T/4: take a snapshot
        True
        >>> d.on_snapshot(2.0, {1: 5, 2: 7, 3: 9})
        ()
        >>> [d.observe(t, 5) for t in (3.0, 5.0, 6.0)]  # silent for T, the snapshot 3/5 T old
        [False, False, True]
        >>> d.on_snapshot(6.0, {1: 5, 2: 7, 3: 12})  # rank 3 beat meanwhile, ranks 1 and 2 did not
        (1, 2)
        >>> d.adopt((1, 2), now=6.0); d.successor()
        3

    .. versionadded:: 0.3.0
    """

    def __init__(self, rank: int, world_size: int, timeout: float, now: float, unborn_count: bool = True) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._unborn_count = unborn_count
        self.dead: set[int] = set()
        self._watched = self.successor()
        self._value: int | None = None  # the successor's counter when it last changed (None: not read yet)
        self._since = now  # when it last changed (or the watch began)
        self._first: tuple[float, Mapping[int, int | None]] | None = None  # the suspicion's snapshot

    def successor(self) -> int | None:
        """The rank this one watches: the next one in rank order, past the dead (None when all others are)."""
        for step in range(1, self.world_size):
            peer = (self.rank + step) % self.world_size
            if peer not in self.dead:
                return peer
        return None

    def observe(self, now: float, value: int | None) -> bool:
        """Record the successor's counter as read at ``now``; True when the driver must take a snapshot."""
        if value == 0 and not self._unborn_count:
            self._value, self._since, self._first = value, now, None
            return False
        if self._value is None:  # the first read: silence counts from the start of the watch
            self._value = value
        elif value != self._value:
            self._value, self._since, self._first = value, now, None
            return False
        silent = now - self._since
        if self._first is None:
            return silent > SUSPECT_AFTER * self.timeout
        # T less half a beat: read once a beat, a successor silent for T is found so at the sixth read, however
        # late by less than half a beat that read or the one that saw the last change came.
        declared = silent >= self.timeout * (1 - 1 / 12)
        return declared and now - self._first[0] >= TOGETHER_AFTER * self.timeout

    def silence(self, now: float) -> float:
        """How long the successor has been silent at ``now``."""
        return now - self._since

    def on_snapshot(self, now: float, beats: Mapping[int, int | None]) -> tuple[int, ...]:
        """Take a snapshot of every other live rank's counter; return the cut to propose (empty: none yet)."""
        if self._watched is None or beats.get(self._watched) != self._value:
            if self._watched is not None:
                self.observe(now, beats.get(self._watched))  # it beat after all
            return ()
        if self._first is None:
            self._first = (now, dict(beats))
            return ()
        _, first = self._first
        self._first = None
        return tuple(
            sorted(
                r
                for r, v in beats.items()
                if r not in self.dead and r in first and first[r] == v and (v or self._unborn_count)
            )
        )

    def adopt(self, ranks: tuple[int, ...], now: float) -> None:
        """Ranks declared dead (by this rank's cut or another's): watch the next live rank from ``now``."""
        self.dead.update(ranks)
        watched = self.successor()
        if watched != self._watched:
            self._watched, self._value, self._since, self._first = watched, None, now, None

    @property
    def watched(self) -> int | None:
        """The rank whose counter :meth:`observe` expects."""
        return self._watched
