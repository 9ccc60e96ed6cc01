"""An arena's counters: one 64-byte slot per process of a rank (its row), written by that process alone.

A rank's main process takes slot 0 of its row, its DataLoader workers slots ``1 + worker id``; a process that finds
its slot held by another live process (two DataLoaders of one rank iterating at once) counts in the row's last,
shared slot, under the arena's lock.

.. versionadded:: 0.5.0
"""

from __future__ import annotations

from ignite_ext._fs import pid_alive
from ignite_ext.data.cache._mapping import (
    BYTES,
    ENTRIES,
    EVICTED_BYTES,
    EVICTIONS,
    HITS,
    LOADED_AHEAD,
    MISSES,
    OWNER,
    SHARED_SLOT,
    SLOT_WORDS,
    SLOTS_PER_ROW,
    Local,
    Mapped,
    locked,
)

__all__ = ["Counters", "restart_counters"]

_TOTALS = (HITS, MISSES, ENTRIES, BYTES, EVICTIONS, EVICTED_BYTES, LOADED_AHEAD)


def restart_counters(local: Local, rows: int) -> None:
    """A new job or attempt: every counter slot free, hits and misses at zero; entries and bytes stay."""
    for row in range(rows):
        for slot in range(SLOTS_PER_ROW):
            base = (row * SLOTS_PER_ROW + slot) * SLOT_WORDS
            for word in (OWNER, HITS, MISSES):
                local.stats[base + word] = 0


class Counters:
    """The counters' operations, as methods of :class:`~ignite_ext.data.cache.arena.Arena`."""

    def count(
        self: Mapped,
        row: int,
        slot: int,
        *,
        hits: int = 0,
        misses: int = 0,
        entries: int = 0,
        nbytes: int = 0,
        evictions: int = 0,
        evicted_bytes: int = 0,
        loaded_ahead: int = 0,
    ) -> None:
        """Add to the counters of ``row`` (a rank), in ``slot`` (0: main process, 1 + worker id: a worker)."""
        local = self._mapped()
        own = local.claimed.get(row)
        if own is None:
            own = local.claimed[row] = _claim(local, row, slot)
        base = (row * SLOTS_PER_ROW + own) * SLOT_WORDS
        words = local.stats
        # In its own slot this process is the only writer: its threads need only exclude each other. A hit (the
        # call of every cached read) touches its one word.
        with local.thread_lock if own != SHARED_SLOT else locked(local):
            words[base + HITS] += hits
            if misses or entries or nbytes or evictions or evicted_bytes or loaded_ahead:
                words[base + MISSES] += misses
                words[base + ENTRIES] += entries
                words[base + BYTES] += nbytes
                words[base + EVICTIONS] += evictions
                words[base + EVICTED_BYTES] += evicted_bytes
                words[base + LOADED_AHEAD] += loaded_ahead

    def totals(self: Mapped, row: int) -> tuple[int, int, int, int, int, int, int]:
        """``(hits, misses, entries, bytes, evictions, evicted_bytes, loaded_ahead)`` of ``row``, over its processes."""
        words = self._mapped().stats
        sums = [0] * 7
        for slot in range(SLOTS_PER_ROW):
            base = (row * SLOTS_PER_ROW + slot) * SLOT_WORDS
            for k, word in enumerate(_TOTALS):
                sums[k] += words[base + word]
        return sums[0], sums[1], sums[2], sums[3], sums[4], sums[5], sums[6]


def _claim(local: Local, row: int, slot: int) -> int:
    if not 0 <= slot < SHARED_SLOT:
        return SHARED_SLOT
    owner_word = (row * SLOTS_PER_ROW + slot) * SLOT_WORDS + OWNER
    with locked(local):
        owner = local.stats[owner_word]
        if owner not in (0, local.pid) and pid_alive(owner):
            return SHARED_SLOT  # e.g. two DataLoaders of one rank iterating at once: same worker ids
        local.stats[owner_word] = local.pid
    return slot
