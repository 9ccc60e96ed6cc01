"""What an arena that follows its samplers' shards keeps in its data area: free ranges, and ranges being written.

The bookkeeping of a following arena's space (see :mod:`~ignite_ext.data.cache._space`), kept in a region of the
arena's own data area, so every process of the node sees it and it lives and dies with the arena::

    count of free ranges | in-flight table: INFLIGHT x (pid, offset, size) | free offsets: F | free sizes: F

Every write here is ordered so that a process SIGKILLed between two of them (the loading-ahead process is killed
at each epoch's start) leaves space unused until the next rebuild, never a free range over bytes in use.

*Free ranges* are the gaps between the ranges that published entries, in-flight writes and everything below the
arena's *pin* occupy, recomputed from the index table at each eviction (:meth:`FollowSpace.rebuild`), so a range
lost to a killed writer or to a lost publishing race comes back then; between evictions they only shrink, as
:meth:`FollowSpace.take` carves new samples out of the first one that fits. The *in-flight table* holds the ranges
reserved and not yet published, with the reserving pid: a rebuild never hands out a range that a live process is
still writing, and a dead process's ranges are free again.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ignite_ext._fs import pid_alive
from ignite_ext.data.cache._mapping import ALIGN

__all__ = ["INFLIGHT", "FollowSpace", "space_bytes"]

#: Reservations being written at once, per arena (a DataLoader worker or thread holds one at a time).
INFLIGHT = 256
_PID, _OFFSET, _SIZE = range(3)


def space_bytes(n: int) -> int:
    """Bytes of the bookkeeping region of an arena of ``n`` indices.

    There are at most ``F = n + INFLIGHT + 1`` free ranges: one before each live or in-flight range, and one after.

    Examples:
        >>> from ignite_ext.data.cache._follow import INFLIGHT, space_bytes
        >>> space_bytes(0) == 8 * (1 + 3 * INFLIGHT + 2 * (INFLIGHT + 1))
        True

    .. versionadded:: 0.4.0
    """
    return 8 * (1 + 3 * INFLIGHT + 2 * _ranges(n))


def _ranges(n: int) -> int:
    return n + INFLIGHT + 1


class FollowSpace:
    """The bookkeeping region at ``offset`` of ``data`` (an arena's data area), for ``n`` indices.

    Every method runs under the arena's lock: the region is shared by every process of the node.

    Examples:
        >>> import numpy as np
        >>> from ignite_ext.data.cache._follow import FollowSpace, space_bytes
        >>> space = FollowSpace(bytearray(space_bytes(4) + 4096), 0, 4)
        >>> space.rebuild(np.array([128]), np.array([64]), pin=0, used=1024)  # one live range in [0, 1024)
        >>> space.free_bytes()
        960
        >>> space.take(128), space.take(64), space.take(832)  # first fit: [0, 128), then [192, 1024)
        (0, 192, None)

    .. versionadded:: 0.4.0
    """

    def __init__(self, data: Any, offset: int, n: int) -> None:
        words = np.frombuffer(data, dtype=np.uint64, count=space_bytes(n) // 8, offset=offset)
        self._count = words[:1]
        self._inflight = words[1 : 1 + 3 * INFLIGHT].reshape(INFLIGHT, 3)
        start = 1 + 3 * INFLIGHT
        ranges = _ranges(n)
        self._offsets = words[start : start + ranges]
        self._sizes = words[start + ranges : start + 2 * ranges]

    def take(self, nbytes: int) -> int | None:
        """Carve ``nbytes`` (a multiple of ``ALIGN``) out of the first free range that holds them; None if none does."""
        count = int(self._count[0])
        if count == 0:
            return None
        sizes = self._sizes[:count]
        first = int(np.argmax(sizes >= nbytes))
        if sizes[first] < nbytes:
            return None
        offset = int(self._offsets[first])
        # The size first: killed between the two, the range keeps its start and loses its end (space lost until the
        # next rebuild), never the other way round, which would make it reach into the next range's bytes.
        sizes[first] -= np.uint64(nbytes)
        self._offsets[first] += np.uint64(nbytes)
        return offset

    def free_bytes(self) -> int:
        """Bytes in the free ranges."""
        return int(self._sizes[: int(self._count[0])].sum())

    def hold(self, pid: int, offset: int, nbytes: int) -> bool:
        """Record that ``pid`` writes ``[offset, offset + nbytes)``; False if every slot is held by a live process."""
        table = self._inflight
        free = np.flatnonzero(table[:, _PID] == 0)
        if not len(free):
            dead = [slot for slot in range(INFLIGHT) if not pid_alive(int(table[slot, _PID]))]
            if not dead:
                return False
            free = np.array(dead)
        slot = int(free[0])
        table[slot, _OFFSET], table[slot, _SIZE] = offset, nbytes
        table[slot, _PID] = pid  # last: a slot killed half-written has no pid, and holds nothing
        return True

    def release(self, pid: int, offset: int) -> None:
        """Forget ``pid``'s write at ``offset`` (published, lost to another writer, or abandoned)."""
        table = self._inflight
        for slot in np.flatnonzero((table[:, _PID] == pid) & (table[:, _OFFSET] == offset)):
            table[int(slot), _PID] = 0

    def rebuild(self, live_offsets: np.ndarray, live_sizes: np.ndarray, pin: int, used: int) -> None:
        """Make the free ranges the gaps in ``[pin, used)`` between the live ranges and the live in-flight ones.

        Slots of dead processes are emptied: what they were writing is free again.
        """
        table = self._inflight
        for slot in np.flatnonzero(table[:, _PID] != 0):
            if not pid_alive(int(table[slot, _PID])):
                table[int(slot), _PID] = 0
        held = table[table[:, _PID] != 0]  # a copy
        starts = np.concatenate([live_offsets.astype(np.int64), held[:, _OFFSET].astype(np.int64)])
        ends = starts + np.concatenate([live_sizes.astype(np.int64), held[:, _SIZE].astype(np.int64)])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        # Where the space taken so far ends, before each range starts: ranges never overlap, but a max costs nothing.
        covered = np.maximum.accumulate(np.concatenate([[pin], np.maximum(ends, pin)]))
        gap_starts = np.concatenate([covered[:-1], covered[-1:]])
        gap_ends = np.concatenate([np.maximum(starts, pin), [used]])
        gap_starts = (gap_starts + ALIGN - 1) // ALIGN * ALIGN
        keep = gap_ends - gap_starts >= ALIGN
        gap_starts, gap_ends = gap_starts[keep], gap_ends[keep]
        count = len(gap_starts)
        self._count[0] = 0  # killed while the ranges are rewritten, there are none until the next rebuild
        self._offsets[:count] = gap_starts
        self._sizes[:count] = gap_ends - gap_starts
        self._count[0] = count
