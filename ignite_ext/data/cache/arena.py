"""The shared-memory store behind :class:`~ignite_ext.data.CachedDataset`: one arena file per cache in ``/dev/shm``.

An arena is a plain tmpfs file mapped by every process that reads the cache, so its pages exist once per node
however many processes map it. It holds::

    header (4 KiB) | index table: n x (state, offset, length) | counters | data (bump-allocated, 64-byte aligned)

The data area starts on a page boundary and a range may be reserved at a given offset from one, so that the large
buffers of a sample start on pages of their own and can be lent copy-on-write (:meth:`Arena.borrow`).

*Publish when complete*: a writer reserves a range (under the lock), copies the sample into it (no lock) and then,
under the lock again, writes offset and length and flips the entry's state to READY last. Readers never lock: an
entry they see READY is complete and never changes again (nothing is evicted). A writer killed before it publishes
leaves an EMPTY entry and a few wasted bytes, never a half entry; a second writer of the same entry finds it taken at
publish time and its range is simply not used.

The lock is ``flock`` on a small ``.lock`` file next to the arena: the kernel releases it when its holder dies, so a
SIGKILLed worker cannot wedge the others. The creating process also holds a shared ``flock`` on the arena for its
whole life; that, and a file name carrying its pid, is how a later process tells an arena left behind by a killed
run (and sweeps it) from one still in use.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ignite_ext._fs import pid_alive
from ignite_ext.data.cache import shm
from ignite_ext.data.cache._cow import PAGE, CowMap
from ignite_ext.data.cache.shm import MIN_CAPACITY, SHM_DIR, remove_files
from ignite_ext.errors import ShmSpaceError

__all__ = ["MAX_WORKERS", "Arena"]

_MAGIC = 0x49474E4954455843  # "IGNITEXC"
_VERSION = 1
_HEADER_BYTES = 4096
_ALIGN = 64

# Header words.
_H_MAGIC, _H_VERSION, _H_N, _H_CAPACITY, _H_TABLE, _H_STATS, _H_DATA, _H_USED, _H_ROWS, _H_FULL = range(10)
# Index table: three words per dataset index.
_ENTRY_WORDS = 3
_EMPTY, _READY = 0, 1
# Counters: one 64-byte slot (its own cache line, since each slot has one writer) per process of a row.
_SLOT_WORDS = 8
_OWNER, _HITS, _MISSES, _ENTRIES, _BYTES = range(5)
#: Slot 0 is a rank's main process, slots 1..MAX_WORKERS its DataLoader workers; the last slot is shared (locked).
MAX_WORKERS = 64
_SLOTS_PER_ROW = MAX_WORKERS + 2
_SHARED_SLOT = _SLOTS_PER_ROW - 1


def _aligned(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass
class _Local:
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


#: Where a process that has the files open can be reached: (pid, arena fd, arena inode, lock fd, lock inode).
_Origin = tuple[int, int, int, int, int]


def _reopen(path: str, pid: int | None, fd: int, inode: int) -> int:
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


def _origin(local: _Local, pid: int) -> _Origin:
    return (pid, local.arena_fd, os.fstat(local.arena_fd).st_ino, local.lock_fd, os.fstat(local.lock_fd).st_ino)


def _open_local(
    path: str, origin: _Origin | None = None, arena_fd: int | None = None, mm: mmap.mmap | None = None
) -> _Local:
    pid, afd, aino, lfd, lino = origin if origin is not None else (None, -1, -1, -1, -1)
    lock_fd = _reopen(path[: -len(".arena")] + ".lock", pid, lfd, lino)
    if arena_fd is None:
        arena_fd = _reopen(path, pid, afd, aino)
    if mm is None:
        mm = mmap.mmap(arena_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    whole = memoryview(mm)
    header = whole[:_HEADER_BYTES].cast("Q")
    if header[_H_MAGIC] != _MAGIC or header[_H_VERSION] != _VERSION:
        raise RuntimeError(f"{path} is not a cache arena of this version")
    n, rows = header[_H_N], header[_H_ROWS]
    table_off, stats_off, data_off = header[_H_TABLE], header[_H_STATS], header[_H_DATA]
    return _Local(
        pid=os.getpid(),
        mm=mm,
        arena_fd=arena_fd,
        lock_fd=lock_fd,
        header=header,
        table=whole[table_off : table_off + n * _ENTRY_WORDS * 8].cast("Q"),
        stats=whole[stats_off : stats_off + rows * _SLOTS_PER_ROW * _SLOT_WORDS * 8].cast("Q"),
        data=whole[data_off : data_off + header[_H_CAPACITY]],
        claimed={},
        thread_lock=threading.Lock(),
    )


def _close_local(local: _Local) -> None:
    if local.cow is not None:
        local.cow.close()
    for view in (local.header, local.table, local.stats, local.data):
        view.release()
    with contextlib.suppress(BufferError):  # a caller still holds a view: the mapping goes with the process
        local.mm.close()
    for fd in (local.arena_fd, local.lock_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def _finalize(path: str, creator: int, liveness_fd: int) -> None:
    # Forked children inherit the finalizer registry: only the creating process may delete the files.
    if os.getpid() != creator:
        return
    remove_files([path, path[: -len(".arena")] + ".lock"])
    with contextlib.suppress(OSError):
        os.close(liveness_fd)


class Arena:
    """One cache's shared memory: the index table, the per-process counters and the data area.

    Create it once with :meth:`create` (in the process that owns the cache) and :meth:`attach` it anywhere else
    on the node. It pickles as its path only; a process that unpickles it maps the file on first use, and a
    forked process reopens its own lock descriptor (a ``flock`` shared with the parent would not exclude it).

    Examples:
        >>> from ignite_ext.data.cache.arena import Arena
        >>> arena = Arena.create(n=4, capacity=1 << 20)
        >>> offset = arena.reserve(0, 3)
        >>> arena.data_view(offset, 3)[:] = b"abc"
        >>> arena.publish(0, offset, 3)
        True
        >>> bytes(arena.lookup(0))
        b'abc'
        >>> arena.lookup(1) is None
        True
        >>> arena.close()

    .. versionadded:: 0.1.0
    """

    def __init__(self, path: str, origin: _Origin | None = None) -> None:
        self.path = path
        self._origin = origin  # a process to reopen the files through if the creator has deleted them
        self._local: _Local | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @classmethod
    def create(
        cls, n: int, capacity: int | None = None, rows: int = 1, directory: str = SHM_DIR, share: int = 1
    ) -> Arena:
        """Create an arena for ``n`` indices and ``capacity`` bytes of data; it is deleted when this process exits.

        Args:
            n: number of dataset indices.
            capacity: bytes of sample data; ``None`` takes :data:`~.shm.DEFAULT_FRACTION` of the free space.
            rows: number of counter rows (one per rank sharing the arena).
            directory: the tmpfs to create it in.
            share: with ``capacity=None``, the number of caches being created together that split the default
                (the ranks of a node, each creating its own): each takes ``1/share`` of it.

        Raises:
            ShmSpaceError: the tmpfs lacks room for the table plus ``capacity`` (or plus :data:`~.shm.MIN_CAPACITY`
                when ``capacity`` is ``None``).
            ValueError: ``n`` is negative or ``capacity`` not positive.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity}")
        if not os.path.isdir(directory):
            raise ShmSpaceError(f"{directory} does not exist: the cache needs a tmpfs for shared memory")
        with shm.directory_lock(directory):  # concurrent creators must see each other's claims
            shm.sweep_stale(directory)
            table_off = _HEADER_BYTES
            stats_off = _aligned(table_off + n * _ENTRY_WORDS * 8)
            data_off = _aligned(stats_off + rows * _SLOTS_PER_ROW * _SLOT_WORDS * 8, PAGE)  # see borrow()
            free = shm.available_bytes(directory)
            if capacity is None:
                # Arenas fill lazily: what live caches may still claim is not free for a new default.
                unclaimed = free - shm.promised_bytes(directory)
                capacity = int((unclaimed - data_off) * shm.DEFAULT_FRACTION / max(1, share)) // _ALIGN * _ALIGN
                if capacity < MIN_CAPACITY:
                    raise ShmSpaceError(
                        f"{directory} has {free} bytes free, {unclaimed} of them not promised to other caches; a cache "
                        f"of {n} samples needs {data_off} bytes for its index plus at least {MIN_CAPACITY} for data. "
                        "Enlarge it (e.g. docker run --shm-size=8g) or pass capacity_bytes."
                    )
            elif data_off + capacity > free:
                raise ShmSpaceError(
                    f"capacity_bytes={capacity} plus {data_off} bytes of index exceed the {free} bytes free in "
                    f"{directory}; lower capacity_bytes or enlarge {directory}"
                )
            stem = os.path.join(directory, f"ignite_ext_{os.getpid()}_cache_{secrets.token_hex(8)}")
            path = stem + ".arena"
            os.close(os.open(stem + ".lock", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            arena_fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            liveness_fd = os.open(path, os.O_RDONLY)
            fcntl.flock(liveness_fd, fcntl.LOCK_SH)
            self = cls(path)
            self._finalizer = weakref.finalize(self, _finalize, path, os.getpid(), liveness_fd)
            try:
                os.ftruncate(arena_fd, data_off + capacity)  # sparse: data pages are allocated as samples arrive
                os.posix_fallocate(arena_fd, 0, data_off)
                mm = mmap.mmap(arena_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                header = memoryview(mm)[:_HEADER_BYTES].cast("Q")
                for word, value in (
                    (_H_N, n),
                    (_H_CAPACITY, capacity),
                    (_H_TABLE, table_off),
                    (_H_STATS, stats_off),
                    (_H_DATA, data_off),
                    (_H_ROWS, rows),
                    (_H_VERSION, _VERSION),
                    (_H_MAGIC, _MAGIC),  # last: an attacher checks it
                ):
                    header[word] = value
                header.release()
                self._local = _open_local(path, arena_fd=arena_fd, mm=mm)
            except BaseException:
                if self._local is None:
                    os.close(arena_fd)
                self._finalizer()
                raise
        return self

    @classmethod
    def attach(cls, path: str) -> Arena:
        """Map an existing arena (created by another process of this node); never deletes it."""
        self = cls(path)
        self._mapped()
        return self

    def __reduce__(self) -> tuple[type[Arena], tuple[str, _Origin | None]]:
        # The pickling process (a rank, for its DataLoader workers) outlives what it pickles for: workers can
        # reopen the files through its descriptors even if the node's creating rank has exited meanwhile.
        local = self._local
        origin = _origin(local, local.pid) if local is not None and local.pid == os.getpid() else self._origin
        return type(self), (self.path, origin)

    def _mapped(self) -> _Local:
        local = self._local
        if local is not None and local.pid == os.getpid():
            return local
        if local is None:
            local = _open_local(self.path, self._origin)
        else:  # forked: the inherited mapping is valid, but the lock needs an open file description of its own
            local = _open_local(self.path, _origin(local, os.getpid()), local.arena_fd, local.mm)
        self._local = local
        return local

    @contextlib.contextmanager
    def _locked(self, local: _Local) -> Iterator[None]:
        with local.thread_lock:
            fcntl.flock(local.lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(local.lock_fd, fcntl.LOCK_UN)

    @property
    def size(self) -> int:
        """Number of dataset indices the arena has entries for."""
        return int(self._mapped().header[_H_N])

    @property
    def capacity(self) -> int:
        """Bytes of the data area."""
        return int(self._mapped().header[_H_CAPACITY])

    @property
    def used(self) -> int:
        """Bytes of the data area handed out so far (published entries plus ranges of lost races)."""
        return int(self._mapped().header[_H_USED])

    @property
    def full(self) -> bool:
        """Whether an allocation has failed for lack of room."""
        return bool(self._mapped().header[_H_FULL])

    def lookup(self, index: int) -> memoryview | None:
        """Return the published bytes of ``index`` (a view into the arena), or ``None`` if it has none."""
        local = self._mapped()
        base = index * _ENTRY_WORDS
        if local.table[base] != _READY:
            return None
        offset, length = local.table[base + 1], local.table[base + 2]
        return local.data[offset : offset + length]

    def reserve(self, index: int, nbytes: int, page_offset: int | None = None) -> int | None:
        """Hand out ``nbytes`` of the data area for ``index``; ``None`` if it is already published or no room.

        The range starts at a multiple of 64 bytes or, with ``page_offset`` (a multiple of 64), ``page_offset``
        bytes before a page boundary of the file (see :attr:`~ignite_ext.data.cache.codec.Encoded.page_offset`).
        """
        local = self._mapped()
        header = local.header
        size = _aligned(nbytes)
        if local.table[index * _ENTRY_WORDS] != _EMPTY or header[_H_USED] + size > header[_H_CAPACITY]:
            return None  # checked without the lock first, so a full cache costs no lock per miss
        with self._locked(local):
            offset = header[_H_USED]
            if page_offset is not None:  # the data area starts on a page: offsets in it are file offsets mod PAGE
                offset += (-(offset + page_offset)) % PAGE
            if local.table[index * _ENTRY_WORDS] != _EMPTY or offset + size > header[_H_CAPACITY]:
                return None
            try:
                # Reserve the pages now: writing to a hole of a full tmpfs would kill this process with SIGBUS.
                os.posix_fallocate(local.arena_fd, header[_H_DATA] + offset, size)
            except OSError:
                header[_H_FULL] = 1
                return None
            header[_H_USED] = offset + size
        return int(offset)

    def borrow(self, index: int, start: int, nbytes: int) -> memoryview | None:
        """A private, copy-on-write view of bytes ``start:start + nbytes`` of the published entry of ``index``.

        Writing to the view (or to a tensor built on it) copies the pages written, for this process only: the
        arena is never changed. ``None`` when the range is not page-aligned in the arena, is lent already (a
        tensor built on an earlier view of it is still alive in this process), or this kernel does not report
        the page flags this needs; then the caller copies. No other range that is ever lent may start in the
        range's last page (the codec and :meth:`reserve` start every lendable buffer on a page).
        """
        local = self._mapped()
        if not local.cow_opened:
            with local.thread_lock:
                if not local.cow_opened:
                    local.cow = CowMap.open(local.arena_fd)
                    local.cow_opened = True
        if local.cow is None or local.table[index * _ENTRY_WORDS] != _READY:
            return None
        return local.cow.lend(local.header[_H_DATA] + local.table[index * _ENTRY_WORDS + 1] + start, nbytes)

    def data_view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of a reserved range."""
        return self._mapped().data[offset : offset + nbytes]

    def publish(self, index: int, offset: int, nbytes: int) -> bool:
        """Make a fully written range the entry of ``index``; ``False`` if another writer published it first."""
        local = self._mapped()
        base = index * _ENTRY_WORDS
        with self._locked(local):
            if local.table[base] != _EMPTY:
                return False
            local.table[base + 1] = offset
            local.table[base + 2] = nbytes
            local.table[base] = _READY  # last: readers take READY to mean complete
        return True

    def count(self, row: int, slot: int, *, hits: int = 0, misses: int = 0, entries: int = 0, nbytes: int = 0) -> None:
        """Add to the counters of ``row`` (a rank), in ``slot`` (0: main process, 1 + worker id: a worker)."""
        local = self._mapped()
        own = local.claimed.get(row)
        if own is None:
            own = local.claimed[row] = self._claim(local, row, slot)
        base = (row * _SLOTS_PER_ROW + own) * _SLOT_WORDS
        words = local.stats
        # In its own slot this process is the only writer: its threads need only exclude each other.
        with local.thread_lock if own != _SHARED_SLOT else self._locked(local):
            words[base + _HITS] += hits
            words[base + _MISSES] += misses
            words[base + _ENTRIES] += entries
            words[base + _BYTES] += nbytes

    def _claim(self, local: _Local, row: int, slot: int) -> int:
        if not 0 <= slot < _SHARED_SLOT:
            return _SHARED_SLOT
        owner_word = (row * _SLOTS_PER_ROW + slot) * _SLOT_WORDS + _OWNER
        with self._locked(local):
            owner = local.stats[owner_word]
            if owner not in (0, local.pid) and pid_alive(owner):
                return _SHARED_SLOT  # e.g. two DataLoaders of one rank iterating at once: same worker ids
            local.stats[owner_word] = local.pid
        return slot

    def totals(self, row: int) -> tuple[int, int, int, int]:
        """``(hits, misses, entries, bytes)`` of ``row``, summed over every process that counted in it."""
        words = self._mapped().stats
        sums = [0, 0, 0, 0]
        for slot in range(_SLOTS_PER_ROW):
            base = (row * _SLOTS_PER_ROW + slot) * _SLOT_WORDS
            for k, word in enumerate((_HITS, _MISSES, _ENTRIES, _BYTES)):
                sums[k] += words[base + word]
        return sums[0], sums[1], sums[2], sums[3]

    def close(self) -> None:
        """Unmap in this process and, in the creating process, delete the files (mappings elsewhere stay valid)."""
        if self._local is not None and self._local.pid == os.getpid():
            _close_local(self._local)
        self._local = None
        if self._finalizer is not None:
            self._finalizer()
