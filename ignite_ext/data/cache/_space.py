"""How an arena hands out its data area and serves what it holds: one policy per mode, each a class of its own.

*Append only* (:class:`AppendOnly`, every arena's mode at first): ranges come from the unused tail and are never
reused, so a published entry never changes: reads are views, and large buffers are lent copy-on-write.

*Following* (:class:`Following`, from an arena's first :meth:`Following.follow`, for good): entries that left the
set kept are evicted and their space handed to new samples (:mod:`~ignite_ext.data.cache._follow`), so reads copy
the bytes out and keep the copy only if the era word (bumped under the lock after the evicted entries are emptied,
before any freed range is handed out) did not change meanwhile; nothing is lent. What was stored before stays put.

Any process of the node may make the arena follow. A process keeps the policy it last saw (``Local.space``), and
:class:`AppendOnly` asks the header whenever the answer matters: before handing out space, again under the lock,
and *after* reading an entry (asked before, another process could start following, publish the entry in reusable
space, evict it and reuse the space under the view returned).

.. versionadded:: 0.5.0
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

from ignite_ext.data.cache._cow import PAGE
from ignite_ext.data.cache._follow import FollowSpace, space_bytes
from ignite_ext.data.cache._mapping import (
    ALIGN,
    EMPTY,
    ENTRY_WORDS,
    H_CAPACITY,
    H_DATA,
    H_DIGEST,
    H_ERA,
    H_FOLLOW,
    H_FULL,
    H_N,
    H_PIN,
    H_USED,
    READY,
    Local,
    aligned,
    locked,
)

__all__ = ["AppendOnly", "Followed", "Following", "follow_space"]


class Followed(NamedTuple):
    """What :meth:`Following.follow` did: entries evicted, their bytes, and whether the arena follows."""

    evicted: int
    evicted_bytes: int
    following: bool


def follow_space(local: Local) -> FollowSpace | None:
    """The bookkeeping of a following arena (see :mod:`~ignite_ext.data.cache._follow`), or None."""
    follow = int(local.header[H_FOLLOW])
    if not follow:
        return None
    if local.follow is None:
        local.follow = FollowSpace(local.mm, int(local.header[H_DATA]) + follow - 1, int(local.header[H_N]))
    return local.follow  # type: ignore[no-any-return]


def _allocate(local: Local, offset: int, size: int) -> bool:
    """Reserve the pages of ``[offset, offset + size)`` of the data area; False (the arena marked full) if no room.

    Now, not at the first write: writing to a hole of a full tmpfs would kill the writer with SIGBUS.
    """
    try:
        os.posix_fallocate(local.arena_fd, local.header[H_DATA] + offset, size)
    except OSError:
        local.header[H_FULL] = 1
        return False
    return True


class AppendOnly:
    """The policy of an arena that does not follow: see the module docstring."""

    @staticmethod
    def read(local: Local, base: int) -> memoryview | None:
        """The published bytes of the entry at ``base`` of the table, a view; None if it has none."""
        table = local.table
        if table[base] != READY:
            return None
        offset, length = table[base + 1], table[base + 2]
        if local.header[H_FOLLOW]:  # asked after the entry (see the module docstring)
            local.space = Following
            return Following.read(local, base)
        return local.data[offset : offset + length]

    @staticmethod
    def reserve(local: Local, index: int, size: int, page_offset: int | None) -> int | None:
        """``size`` bytes of the tail for ``index`` (see :meth:`Arena.reserve <.arena.Arena.reserve>`)."""
        header = local.header
        if header[H_FOLLOW]:
            local.space = Following
            return Following.reserve(local, index, size, page_offset)
        if local.table[index * ENTRY_WORDS] != EMPTY or header[H_USED] + size > header[H_CAPACITY]:
            return None  # checked without the lock first, so a full cache costs no lock per miss
        with locked(local):
            if header[H_FOLLOW]:  # another process made it follow since the check above: its tail is reusable
                local.space = Following
                return Following.take(local, index, size)
            offset = header[H_USED]
            if page_offset is not None:  # the data area starts on a page: offsets in it are file offsets mod PAGE
                offset += (-(offset + page_offset)) % PAGE
            if local.table[index * ENTRY_WORDS] != EMPTY or offset + size > header[H_CAPACITY]:
                return None
            if not _allocate(local, offset, size):
                return None
            header[H_USED] = offset + size
        return int(offset)

    @staticmethod
    def lend(local: Local, base: int, start: int, nbytes: int) -> memoryview | None:
        """A copy-on-write view of bytes of the published entry at ``base`` (see :meth:`Arena.borrow`)."""
        if local.cow is None or local.table[base] != READY:
            return None
        offset = local.table[base + 1]
        if local.header[H_FOLLOW]:  # asked after the entry is read, as in read(): a range that may be reused
            local.space = Following
            return None
        return local.cow.lend(local.header[H_DATA] + offset + start, nbytes)

    @staticmethod
    def release(local: Local, offset: int) -> None:
        """Nothing to forget: a range of the tail is nobody's until published (called under the lock)."""


class Following:
    """The policy of an arena that follows its readers' shards: see the module docstring."""

    @staticmethod
    def read(local: Local, base: int) -> memoryview | None:
        """A private copy of the published bytes of the entry at ``base``, or None if it has none.

        The copy is kept when no eviction happened during it (the era is the same after as before), else taken again.
        """
        table, header = local.table, local.header
        for _ in range(3):  # an eviction during the copy: look again (the entry may be gone, or elsewhere)
            era = header[H_ERA]
            if table[base] != READY:
                return None
            offset, length = table[base + 1], table[base + 2]
            copy = bytearray(local.data[offset : offset + length])
            if header[H_ERA] == era:
                return memoryview(copy)
        return None

    @staticmethod
    def reserve(local: Local, index: int, size: int, page_offset: int | None) -> int | None:
        """The first free range that fits ``size``, else the unused tail (``page_offset``: nothing is lent here)."""
        if local.table[index * ENTRY_WORDS] != EMPTY or local.header[H_FULL]:
            return None  # full since the last eviction (which clears the flag): no lock per miss
        with locked(local):
            return Following.take(local, index, size)

    @staticmethod
    def take(local: Local, index: int, size: int) -> int | None:
        """:meth:`reserve`'s work, under the lock: the range, recorded as being written by this process."""
        header = local.header
        space = follow_space(local)
        if space is None or local.table[index * ENTRY_WORDS] != EMPTY:
            return None
        offset = space.take(size)
        if offset is None:
            offset = int(header[H_USED])
            if offset + size > header[H_CAPACITY]:
                header[H_FULL] = 1
                return None
            if not _allocate(local, offset, size):
                return None
            header[H_USED] = offset + size
        if not space.hold(local.pid, offset, size):
            return None  # every in-flight slot is a live writer's: the range comes back at the next eviction
        return offset

    @staticmethod
    def lend(local: Local, base: int, start: int, nbytes: int) -> memoryview | None:
        """Nothing is lent: a range may be reused once evicted."""
        return None

    @staticmethod
    def release(local: Local, offset: int) -> None:
        """Forget this process's write at ``offset`` (published, lost, or abandoned; called under the lock)."""
        if (space := follow_space(local)) is not None:
            space.release(local.pid, offset)

    @staticmethod
    def follow(local: Local, keep: Iterable[int] | Any) -> Followed:
        """Keep the entries of ``keep`` only (see :meth:`Arena.follow <.arena.Arena.follow>`), following from now on."""
        import numpy as np

        header = local.header
        n = int(header[H_N])
        indices = np.fromiter(keep, dtype=np.int64) if not isinstance(keep, np.ndarray) else keep.astype(np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= n):
            raise ValueError(f"follow() keeps indices of range({n}), got {int(indices.min())}..{int(indices.max())}")
        wanted = np.zeros(n, dtype=bool)
        wanted[indices] = True
        digest = int.from_bytes(hashlib.blake2b(np.packbits(wanted).tobytes(), digest_size=8).digest(), "little") | 1
        if header[H_FOLLOW] and header[H_DIGEST] == digest:
            return Followed(0, 0, True)
        with locked(local):
            space = follow_space(local) or Following._start(local, n)
            if space is None:
                return Followed(0, 0, False)
            local.space = Following
            if header[H_DIGEST] == digest:
                return Followed(0, 0, True)
            table = np.frombuffer(local.table, dtype=np.uint64).reshape(n, ENTRY_WORDS)
            ready = table[:, 0] == READY
            gone = ready & ~wanted
            evicted, evicted_bytes = int(gone.sum()), int(table[gone, 2].sum())
            table[gone, 0] = EMPTY
            # Then the era, and only then is any freed range handed out: a reader that saw the old era and copies
            # bytes written later sees the new era after its copy; one that sees the new era sees the entry EMPTY.
            header[H_ERA] += 1
            live = table[ready & wanted]
            sizes = (live[:, 2] + (ALIGN - 1)) // ALIGN * ALIGN
            space.rebuild(live[:, 1], sizes, pin=int(header[H_PIN]), used=int(header[H_USED]))
            header[H_FULL] = 0
            header[H_DIGEST] = digest
            del table, live
        return Followed(evicted, evicted_bytes, True)

    @staticmethod
    def _start(local: Local, n: int) -> FollowSpace | None:
        """Make the arena following, under its lock: the bookkeeping region taken from the unused tail."""
        header = local.header
        offset, size = int(header[H_USED]), aligned(space_bytes(n))
        if offset + size > header[H_CAPACITY]:
            return None
        try:
            os.posix_fallocate(local.arena_fd, header[H_DATA] + offset, size)
        except OSError:
            return None
        header[H_USED] = header[H_PIN] = offset + size  # what is stored so far may have been lent: kept in place
        header[H_FOLLOW] = offset + 1  # last: lookups copy from now on
        return follow_space(local)
