"""The layout of an arena file, and what one process holds of it (its mapping, descriptors and views).

See :mod:`ignite_ext.data.cache.arena` for what the parts are for.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ignite_ext.data.cache._cow import CowMap

#: This process's id, kept by a handler in the child of every ``os.fork`` (forked DataLoader workers, load-ahead):
#: the hit path needs it three times per sample, and ``os.getpid`` is a system call (0.2 us each, of a 10 us hit).
PID = os.getpid()
os.register_at_fork(after_in_child=lambda: globals().update(PID=os.getpid()))

# fmt: off
__all__ = [
    "ALIGN", "BYTES", "EMPTY", "ENTRIES", "ENTRY_WORDS", "EVICTED_BYTES", "EVICTIONS", "HEADER_BYTES", "HITS",
    "H_AGENT", "H_AGENT_ID", "H_CAPACITY", "H_DATA", "H_DIGEST", "H_ERA", "H_FOLLOW", "H_FULL", "H_JOB", "H_KEY",
    "H_MAGIC", "H_N", "H_PIN", "H_ROWS", "H_STATS", "H_TABLE", "H_USED", "H_VERSION", "LOADED_AHEAD", "MAGIC",
    "MAX_WORKERS", "MISSES", "OWNER", "READY", "SHARED_SLOT", "SLOTS_PER_ROW", "SLOT_WORDS", "VERSION", "Local",
    "Mapped", "Origin", "aligned", "close_local", "locked", "open_local", "origin_of", "reopen",
]
# fmt: on

MAGIC = 0x49474E4954455843  # "IGNITEXC"
VERSION = 1
HEADER_BYTES = 4096
ALIGN = 64

# Header words. Those added within VERSION 1 read 0 in older arenas, which means "none" for each (no job, no agent,
# not following), so no new VERSION was needed (it would make every persisted cache unusable). H_JOB, H_KEY, H_AGENT
# and H_AGENT_ID: the stamps (see .restart). H_FOLLOW: 1 + the offset of a following arena's bookkeeping region in
# the data area; nothing below H_PIN is ever reused; H_ERA counts evictions; H_DIGEST names the last set kept.
H_MAGIC, H_VERSION, H_N, H_CAPACITY, H_TABLE, H_STATS, H_DATA, H_USED, H_ROWS, H_FULL, H_JOB, H_KEY = range(12)
H_AGENT, H_AGENT_ID, H_FOLLOW, H_PIN, H_ERA, H_DIGEST = range(12, 18)
# Index table: three words per dataset index.
ENTRY_WORDS = 3
EMPTY, READY = 0, 1
# Counters: one 64-byte slot (its own cache line, since each slot has one writer) per process of a row.
SLOT_WORDS = 8
OWNER, HITS, MISSES, ENTRIES, BYTES, EVICTIONS, EVICTED_BYTES, LOADED_AHEAD = range(8)
#: Slot 0 is a rank's main process, slots 1..MAX_WORKERS its DataLoader workers; the last slot is shared (locked).
MAX_WORKERS = 64
SLOTS_PER_ROW = MAX_WORKERS + 2
SHARED_SLOT = SLOTS_PER_ROW - 1


def aligned(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass
class Local:
    """What one process holds of an arena: its mapping, its own lock descriptor and views of the words."""

    pid: int
    mm: mmap.mmap
    arena_fd: int
    lock_fd: int
    header: memoryview
    table: memoryview
    stats: memoryview
    data: memoryview
    claimed: dict[int, int]  # row -> this process's counter slot in that row
    # flock excludes other processes only: threads of this process share its descriptor, so they take this first.
    thread_lock: threading.Lock
    cow: CowMap | None = None  # the copy-on-write mapping that lends large buffers, once opened
    cow_opened: bool = False
    follow: Any = None  # the FollowSpace of a following arena, once seen (views of mm: dropped before unmapping)
    space: Any = None  # the space policy this process last saw the arena under (see ._space): it only ever follows


#: Where a process that has the files open can be reached: (pid, arena fd, arena inode, lock fd, lock inode).
Origin = tuple[int, int, int, int, int]


class Mapped(Protocol):
    """What an arena's rooms ask of the arena they are methods of: this process's :class:`Local` of it."""

    def _mapped(self) -> Local: ...


def reopen(path: str, pid: int | None, fd: int, inode: int) -> int:
    """Open ``path``, or, once its creator has exited and deleted it, the same file through ``pid``'s descriptor."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        if pid is None:
            raise
    try:
        new = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)  # a fresh open file description of the same inode
    except OSError:
        raise FileNotFoundError(f"{path} is gone: the process that created the cache has exited") from None
    if os.fstat(new).st_ino != inode:  # that descriptor number now names another file
        os.close(new)
        raise FileNotFoundError(f"{path} is gone: the process that created the cache has exited")
    return new


def origin_of(local: Local, pid: int) -> Origin:
    return (pid, local.arena_fd, os.fstat(local.arena_fd).st_ino, local.lock_fd, os.fstat(local.lock_fd).st_ino)


def open_local(
    path: str, origin: Origin | None = None, arena_fd: int | None = None, mm: mmap.mmap | None = None
) -> Local:
    pid, afd, aino, lfd, lino = origin if origin is not None else (None, -1, -1, -1, -1)
    lock_fd = reopen(path[: -len(".arena")] + ".lock", pid, lfd, lino)
    if arena_fd is None:
        arena_fd = reopen(path, pid, afd, aino)
    if mm is None:
        mm = mmap.mmap(arena_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    whole = memoryview(mm)
    header = whole[:HEADER_BYTES].cast("Q")
    if header[H_MAGIC] != MAGIC or header[H_VERSION] != VERSION:
        raise RuntimeError(f"{path} is not a cache file of this version of ignite_ext")
    n, rows = header[H_N], header[H_ROWS]
    table_off, stats_off, data_off = header[H_TABLE], header[H_STATS], header[H_DATA]
    return Local(
        pid=os.getpid(),
        mm=mm,
        arena_fd=arena_fd,
        lock_fd=lock_fd,
        header=header,
        table=whole[table_off : table_off + n * ENTRY_WORDS * 8].cast("Q"),
        stats=whole[stats_off : stats_off + rows * SLOTS_PER_ROW * SLOT_WORDS * 8].cast("Q"),
        data=whole[data_off : data_off + header[H_CAPACITY]],
        claimed={},
        thread_lock=threading.Lock(),
    )


@contextlib.contextmanager
def locked(local: Local) -> Iterator[None]:
    """The arena's lock: ``flock`` excludes the other processes, ``local``'s thread lock this one's other threads."""
    with local.thread_lock:
        fcntl.flock(local.lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(local.lock_fd, fcntl.LOCK_UN)


def close_local(local: Local) -> None:
    local.follow = None
    if local.cow is not None:
        local.cow.close()
    for view in (local.header, local.table, local.stats, local.data):
        view.release()
    with contextlib.suppress(BufferError):  # a caller still holds a view: the mapping goes with the process
        local.mm.close()
    for fd in (local.arena_fd, local.lock_fd):
        with contextlib.suppress(OSError):
            os.close(fd)
