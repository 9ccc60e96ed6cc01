"""The shared-memory store behind :class:`~ignite_ext.data.CachedDataset`: one arena file per cache in ``/dev/shm``.

An arena is a plain tmpfs file mapped by every process that reads the cache, so its pages exist once per node
however many processes map it. A cache's disk tier is an arena too, of the same layout, in a directory on the
node's disk (:mod:`~ignite_ext.data.cache.tiers`); its pages then live in the kernel's page cache. It holds::

    header (4 KiB) | index table: n x (state, offset, length) | counters | data (bump-allocated, 64-byte aligned)

The data area starts on a page boundary and a range may be reserved at a given offset from one, so that the large
buffers of a sample start on pages of their own and can be lent copy-on-write (:meth:`Arena.borrow`).

*Publish when complete*: a writer reserves a range (under the lock), copies the sample into it (no lock) and then,
under the lock again, writes offset and length and flips the entry's state to READY last. Readers never lock: an
entry they see READY is complete and, until the arena follows a shard (below), never changes again. A writer killed
before it publishes leaves an EMPTY entry and a few wasted bytes, never a half entry; a second writer of the same
entry finds it taken at publish time and its range is simply not used.

*Following* (:meth:`Arena.follow`, from 0.4.0): told the set of indices its readers will read next (the shard of a
sampler whose shards mix), the arena evicts the other entries and hands their space to new samples (the
bookkeeping is :mod:`~ignite_ext.data.cache._follow`). Since a range may then be rewritten, readers of a following
arena copy the bytes out and keep the copy only if no eviction happened meanwhile (the era word, bumped under the
lock before any freed range can be handed out, is the same before and after the copy), and nothing is lent
copy-on-write: a lent view would change under its holder. What was stored before the arena followed stays where it
is (it may have been lent): its space is never reused.

The lock is ``flock`` on a small ``.lock`` file next to the arena: the kernel releases it when its holder dies, so a
SIGKILLed worker cannot wedge the others. The creating process also holds a shared ``flock`` on the arena for its
whole life; that, and a file name carrying its pid, is how a later process tells an arena left behind by a killed
run (and sweeps it) from one still in use; see :mod:`~ignite_ext.data.cache.shm` for the names.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import mmap
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ignite_ext._fs import own_regular_file, pid_alive
from ignite_ext.data.cache import _mapping, _sigterm, restart, shm
from ignite_ext.data.cache._cow import PAGE, CowMap
from ignite_ext.data.cache._follow import FollowSpace, space_bytes
from ignite_ext.data.cache._mapping import (
    ALIGN,
    BYTES,
    EMPTY,
    ENTRIES,
    ENTRY_WORDS,
    EVICTED_BYTES,
    EVICTIONS,
    H_AGENT,
    H_AGENT_ID,
    H_CAPACITY,
    H_DATA,
    H_DIGEST,
    H_ERA,
    H_FOLLOW,
    H_FULL,
    H_JOB,
    H_KEY,
    H_MAGIC,
    H_N,
    H_PIN,
    H_ROWS,
    H_STATS,
    H_TABLE,
    H_USED,
    H_VERSION,
    HEADER_BYTES,
    HITS,
    LOADED_AHEAD,
    MAGIC,
    MISSES,
    OWNER,
    READY,
    SHARED_SLOT,
    SLOT_WORDS,
    SLOTS_PER_ROW,
    VERSION,
    Local,
    Origin,
    aligned,
    close_local,
    open_local,
    origin_of,
)
from ignite_ext.data.cache.restart import NO_JOB, agent_stamp
from ignite_ext.data.cache.shm import MIN_CAPACITY, SHM_DIR, remove_files
from ignite_ext.errors import ShmSpaceError

__all__ = ["PERSISTED", "PERSIST_ROWS", "Arena", "Followed"]

#: The job stamp of a persisted cache (see .persist): no job's, since job stamps are digests.
PERSISTED = 1
#: Counter rows of a persisted cache at least: a later job may run more ranks per node than the first.
PERSIST_ROWS = 64


class Followed(NamedTuple):
    """What :meth:`Arena.follow` did: entries evicted, their bytes, and whether the arena follows."""

    evicted: int
    evicted_bytes: int
    following: bool


def _layout(n: int, rows: int) -> tuple[int, int, int]:
    """Where the index table, the counters and the data area start in an arena of ``n`` indices and ``rows`` rows."""
    table_off = HEADER_BYTES
    stats_off = aligned(table_off + n * ENTRY_WORDS * 8)
    return table_off, stats_off, aligned(stats_off + rows * SLOTS_PER_ROW * SLOT_WORDS * 8, PAGE)  # see borrow()


def _restart_counters(local: Local, rows: int) -> None:
    """A new job or attempt: every counter slot free, hits and misses at zero; entries and bytes stay."""
    for row in range(rows):
        for slot in range(SLOTS_PER_ROW):
            base = (row * SLOTS_PER_ROW + slot) * SLOT_WORDS
            for word in (OWNER, HITS, MISSES):
                local.stats[base + word] = 0


def _stamps(path: str) -> tuple[int, int, int, int]:
    """``(job, key, n, rows)`` of the arena ``path``; zeros for a file that is not an arena of this version."""
    words = shm.header_words(path, H_KEY + 1)
    if words is None or words[H_MAGIC] != MAGIC or words[H_VERSION] != VERSION:
        return (NO_JOB, 0, 0, 0)
    return (words[H_JOB], words[H_KEY], words[H_N], words[H_ROWS])


def _finalize(path: str, creator: int, liveness_fd: int, keep: bool) -> None:
    # Forked children inherit the finalizer registry: only the creating process may delete the files.
    if os.getpid() != creator:
        return
    # A persisted cache outlives its job (see .persist); an attempt that fails or is SIGTERMed while its live agent
    # has a restart left leaves its arenas to the restarted group, as a SIGKILLed one does.
    if not keep and not (restart.leaving_for_a_restart(_sigterm.terminating()) and shm.agent_lives(path)):
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

    def __init__(self, path: str, origin: Origin | None = None) -> None:
        self.path = path
        self._origin = origin  # a process to reopen the files through if the creator has deleted them
        self._local: Local | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @classmethod
    def create(
        cls,
        n: int,
        capacity: int | None = None,
        rows: int = 1,
        directory: str = SHM_DIR,
        share: int = 1,
        *,
        knob: str = "capacity_bytes",
        advice: str | None = None,
        sweep: bool = True,
        job: int = NO_JOB,
        key: int = 0,
    ) -> Arena:
        """Create an arena for ``n`` indices and ``capacity`` bytes of data; it is deleted when this process exits.

        In a restarted worker group, adopt the arena of the attempt before instead, when it is stamped with this
        ``job`` and ``key`` (see :mod:`~ignite_ext.data.cache.restart`): then its samples are served at once, and
        its capacity is the one it was created with.

        Args:
            n: number of dataset indices.
            capacity: bytes of sample data; ``None`` takes :data:`~.shm.DEFAULT_FRACTION` of the free space.
            rows: number of counter rows (one per rank sharing the arena).
            directory: the directory to create it in: a tmpfs (RAM), or a node-local disk for a disk tier.
            share: with ``capacity=None``, the number of caches being created together that split the default
                (the ranks of a node, each creating its own): each takes ``1/share`` of it.
            knob: the user's name of ``capacity``, for the errors.
            advice: how to make room in ``directory``, for the errors; by default, how to enlarge a tmpfs.
            sweep: whether to sweep this user's stale arenas in ``directory`` first (not where liveness cannot be
                judged from this host: a filesystem that other hosts mount), and adopt one (neither is done there).
            job: the job to stamp the arena with (:func:`~ignite_ext.data.cache.restart.job_key`); :data:`NO_JOB`
                adopts nothing, and the arena is never adopted.
            key: the cache to stamp it with (:func:`~ignite_ext.data.cache.restart.cache_key`).

        Raises:
            ShmSpaceError: the tmpfs lacks room for the table plus ``capacity`` (or plus :data:`~.shm.MIN_CAPACITY`
                when ``capacity`` is ``None``).
            ValueError: ``n`` is negative or ``capacity`` not positive.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"{knob} must be positive, got {capacity}")
        if not os.path.isdir(directory):
            raise ShmSpaceError(f"{directory} does not exist: the cache needs a tmpfs for shared memory")
        if advice is None:
            advice = f"enlarge {directory} (e.g. docker run --shm-size=8g)"
        with shm.directory_lock(directory):  # concurrent creators must see each other's claims
            if sweep and job != NO_JOB and (adopted := cls._adopt(directory, n, rows, job, key)) is not None:
                return adopted
            if sweep:
                shm.sweep_stale(directory)
            return cls._create_locked(n, capacity, rows, directory, share, knob, advice, job, key)

    @classmethod
    def _create_locked(
        cls,
        n: int,
        capacity: int | None,
        rows: int,
        directory: str,
        share: int,
        knob: str,
        advice: str,
        job: int,
        key: int,
        stem: str | None = None,
    ) -> Arena:
        """:meth:`create`'s work once the directory's creation lock is held; at ``stem`` (kept at exit) if given."""
        table_off, stats_off, data_off = _layout(n, rows)
        free = shm.available_bytes(directory)
        if capacity is None:
            # Arenas fill lazily: what live caches may still claim is not free for a new default.
            unclaimed = max(0, free - shm.promised_bytes(directory))
            capacity = int((unclaimed - data_off) * shm.DEFAULT_FRACTION / max(1, share)) // ALIGN * ALIGN
            if capacity < MIN_CAPACITY:
                raise ShmSpaceError(
                    f"{directory} has {free} bytes free, {unclaimed} of them not promised to this user's other "
                    f"caches; a cache of {n} samples needs {data_off} bytes for its index plus at least "
                    f"{MIN_CAPACITY} for data: {advice}, or pass {knob}"
                )
        elif data_off + capacity > free:
            raise ShmSpaceError(
                f"{knob}={capacity} plus {data_off} bytes of index exceed the {free} bytes free in "
                f"{directory}; lower {knob} or {advice}"
            )
        keep = stem is not None
        stem = stem if stem is not None else shm.arena_stem(directory)
        agent = agent_stamp() if job not in (NO_JOB, PERSISTED) else (0, 0)
        path = stem + ".arena"
        os.close(os.open(stem + ".lock", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        arena_fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self = cls._held(path, keep)
        try:
            os.ftruncate(arena_fd, data_off + capacity)  # sparse: data pages are allocated as samples arrive
            os.posix_fallocate(arena_fd, 0, data_off)
            mm = mmap.mmap(arena_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            header = memoryview(mm)[:HEADER_BYTES].cast("Q")
            for word, value in (
                (H_N, n),
                (H_CAPACITY, capacity),
                (H_TABLE, table_off),
                (H_STATS, stats_off),
                (H_DATA, data_off),
                (H_ROWS, rows),
                (H_JOB, job),
                (H_KEY, key),
                (H_AGENT, agent[0]),
                (H_AGENT_ID, agent[1]),
                (H_VERSION, VERSION),
                (H_MAGIC, MAGIC),  # last: an attacher checks it
            ):
                header[word] = value
            header.release()
            self._local = open_local(path, arena_fd=arena_fd, mm=mm)
        except BaseException:
            if self._local is None:
                os.close(arena_fd)
            self.close()
            remove_files([path, stem + ".lock"])  # a half-made file is of no use, kept or not
            raise
        return self

    @classmethod
    def open_persisted(
        cls, directory: str, n: int, rows: int, key: int, capacity: int | None, *, knob: str = "disk_bytes"
    ) -> tuple[Arena | None, bool]:
        """This user's persisted arena ``key`` in ``directory`` (see :mod:`~ignite_ext.data.cache.persist`).

        Opened when a sound one is there (then True: its samples serve at once), else created (False); kept when
        this process exits. Its last use is recorded, and the user's persisted caches in the directory are then
        brought under their cap. A file that fails its checks is deleted (with a
        :class:`~ignite_ext.data.cache.persist.StaleCacheWarning`) and created anew. ``(None, False)`` when the name
        is taken by a file that is not this user's (another user's, or a link): that is never opened nor deleted.

        Raises:
            ShmSpaceError: there is no room for it in ``directory``.

        .. versionadded:: 0.3.0
        """
        from ignite_ext.data.cache import persist

        stem = persist.persisted_stem(directory, key)
        path = stem + ".arena"
        rows = max(rows, PERSIST_ROWS)  # a later job may run more ranks per node
        with shm.directory_lock(directory):
            opened: Arena | None = None
            found = [f for f in (path, stem + ".lock") if os.path.lexists(f)]
            if any(not own_regular_file(Path(f)) for f in found):
                return None, False  # a name another user took: never opened, never deleted
            if found:
                opened, problem = cls._open_persisted(path, n, rows, key)
                if opened is None:
                    warnings.warn(
                        f"the persisted cache {path} was not used: {problem}; it is rebuilt",
                        persist.StaleCacheWarning,
                        stacklevel=7,  # the user's construction of the cache (see tiers.open_tiers)
                    )
                    remove_files([path, stem + ".lock"])
            adopted = opened is not None
            if opened is None:
                advice = f"free space in {directory}"
                opened = cls._create_locked(n, capacity, rows, directory, 1, knob, advice, PERSISTED, key, stem=stem)
            os.utime(stem + ".lock", follow_symlinks=False)  # its last use, for the eviction of the least recent
            persist.evict(directory, keep=path, cap=persist.persist_cap(directory))
        return opened, adopted

    @classmethod
    def _open_persisted(cls, path: str, n: int, rows: int, key: int) -> tuple[Arena | None, str]:
        """The persisted arena ``path`` mapped and checked, or None and what is wrong with it."""
        if not own_regular_file(Path(path[: -len(".arena")] + ".lock")):
            return None, "its lock file is missing"
        job, found_key, found_n, found_rows = _stamps(path)
        if (job, found_key, found_n) != (PERSISTED, key, n) or found_rows < rows:
            return None, f"it is not a persisted cache of {n} samples and at least {rows} ranks with this key"
        alone = shm.unused(path)
        self, problem = cls._held_checked(path, keep=True)
        if problem is not None:
            self.close()
            return None, problem
        if alone:  # no other job counts in it now: this job's hits and misses start at zero
            _restart_counters(self._mapped(), found_rows)
        return self, ""

    @classmethod
    def _held_checked(cls, path: str, keep: bool) -> tuple[Arena, str | None]:
        """``path`` held (:meth:`_held`), mapped and checked (:meth:`consistent`): the arena, and what is wrong."""
        self = cls._held(path, keep)
        try:
            self._mapped()
            return self, self.consistent()
        except (OSError, RuntimeError, ValueError) as exc:
            return self, f"it cannot be mapped ({exc})"

    @classmethod
    def _held(cls, path: str, keep: bool) -> Arena:
        """``path`` as this process's own arena: its liveness lock held, deleted at exit unless ``keep``."""
        liveness_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        fcntl.flock(liveness_fd, fcntl.LOCK_SH)
        self = cls(path)
        self._finalizer = weakref.finalize(self, _finalize, path, os.getpid(), liveness_fd, keep)
        if not keep:
            _sigterm.register(self._finalizer)
        return self

    @classmethod
    def _adopt(cls, directory: str, n: int, rows: int, job: int, key: int) -> Arena | None:
        """The stale arena of ``directory`` stamped ``job`` and ``key``, made this process's own, or None.

        None also when the arena found fails :meth:`consistent` (then it is deleted). Called under the user's
        creation lock of ``directory``, which every sweep holds too. The creator must be gone; the processes it
        forked may not be yet (DataLoader workers notice their parent's death within seconds): they only ever
        publish complete samples of the same dataset, as before.
        """
        for old in shm.orphaned_arenas(directory):
            if _stamps(old) != (job, key, n, rows):
                continue
            stem = shm.arena_stem(directory)
            path = stem + ".arena"
            try:
                os.rename(old, path)  # first: under this process's pid, no sweep takes it for stale
            except OSError:
                continue
            old_lock = old[: -len(".arena")] + ".lock"
            try:
                os.rename(old_lock, stem + ".lock")
            except OSError:
                os.close(os.open(stem + ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600))
            self, problem = cls._held_checked(path, keep=False)
            if problem is not None:
                warnings.warn(
                    f"the cache left by the attempt before in {directory} was not adopted: {problem}; it starts empty",
                    RuntimeWarning,
                    stacklevel=7,  # the user's construction of the cache (see tiers.open_tiers)
                )
                self.close()
                return None
            _restart_counters(self._mapped(), rows)
            return self
        return None

    def consistent(self) -> str | None:
        """What is wrong with this arena's layout or index, or None: every published entry lies in the used area.

        A writer killed before publishing leaves its entry empty (nothing to check); an entry whose words were
        changed by anything else (a bug, a stray write) is found here before any sample of it is served.
        """
        import numpy as np

        local = self._mapped()
        header = local.header
        n, rows = int(header[H_N]), int(header[H_ROWS])
        expected = _layout(n, rows)
        layout = (int(header[H_TABLE]), int(header[H_STATS]), int(header[H_DATA]))
        if layout != expected:
            return f"its header places the index, counters and data at {layout}, not {expected}"
        data_off = expected[2]
        capacity, used = int(header[H_CAPACITY]), int(header[H_USED])
        size = os.fstat(local.arena_fd).st_size
        if size != data_off + capacity or used > capacity:
            return f"{size} bytes for a data area of {capacity} with {used} used"
        follow, pin = int(header[H_FOLLOW]), int(header[H_PIN])
        if follow and (follow - 1 + space_bytes(n) > used or pin > used):
            return (
                f"its shard bookkeeping at {follow - 1} (below {pin} never reused) lies outside the {used} bytes used"
            )
        table = np.frombuffer(local.table, dtype=np.uint64).reshape(n, ENTRY_WORDS)
        states = table[:, 0]
        if np.any((states != EMPTY) & (states != READY)):
            return "an entry is neither empty nor published"
        ready = table[states == READY]
        if np.any(ready[:, 1] > used) or np.any(ready[:, 2] > used - ready[:, 1]):
            return "a published entry lies outside the used part of the data area"
        return None

    @classmethod
    def attach(cls, path: str) -> Arena:
        """Map an existing arena (created by another process of this node); never deletes it."""
        self = cls(path)
        self._mapped()
        return self

    def __reduce__(self) -> tuple[type[Arena], tuple[str, Origin | None]]:
        # The pickling process (a rank, for its DataLoader workers) outlives what it pickles for: workers can
        # reopen the files through its descriptors even if the node's creating rank has exited meanwhile.
        local = self._local
        origin = origin_of(local, local.pid) if local is not None and local.pid == os.getpid() else self._origin
        return type(self), (self.path, origin)

    def _mapped(self) -> Local:
        local = self._local
        if local is not None and local.pid == _mapping.PID:
            return local
        if local is None:
            local = open_local(self.path, self._origin)
        else:  # forked: the inherited mapping is valid, but the lock needs an open file description of its own
            local = open_local(self.path, origin_of(local, os.getpid()), local.arena_fd, local.mm)
        self._local = local
        return local

    @contextlib.contextmanager
    def _locked(self, local: Local) -> Iterator[None]:
        with local.thread_lock:
            fcntl.flock(local.lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(local.lock_fd, fcntl.LOCK_UN)

    @property
    def size(self) -> int:
        """Number of dataset indices the arena has entries for."""
        return int(self._mapped().header[H_N])

    @property
    def capacity(self) -> int:
        """Bytes of the data area."""
        return int(self._mapped().header[H_CAPACITY])

    @property
    def used(self) -> int:
        """Bytes of the data area handed out so far (published entries plus ranges of lost races)."""
        return int(self._mapped().header[H_USED])

    @property
    def full(self) -> bool:
        """Whether an allocation has failed for lack of room (in a following arena: since the last eviction)."""
        return bool(self._mapped().header[H_FULL])

    def lookup(self, index: int) -> memoryview | None:
        """Return the published bytes of ``index``, or ``None`` if it has none.

        A view into the arena; in a following arena (:meth:`follow`), a private copy of the bytes, taken when no
        eviction happened during the copy (a range may be handed to another sample once evicted).
        """
        local = self._mapped()
        base = index * ENTRY_WORDS
        table, header = local.table, local.header
        if table[base] != READY:
            return None
        offset, length = table[base + 1], table[base + 2]
        # Asked after the entry is read: not following then, no eviction ever happened, and the entry was stored
        # where nothing is ever reused (asked before, the arena could start following, evict the entry and reuse its
        # range for another sample under the view returned).
        if not header[H_FOLLOW]:
            return local.data[offset : offset + length]
        for _ in range(3):  # an eviction during the copy: look again (the entry may be gone, or elsewhere)
            era = header[H_ERA]
            if table[base] != READY:
                return None
            offset, length = table[base + 1], table[base + 2]
            copy = bytearray(local.data[offset : offset + length])
            if header[H_ERA] == era:
                return memoryview(copy)
        return None

    def holds(self, index: int) -> bool:
        """Whether ``index`` has a published entry (without copying it, as :meth:`lookup` does in a following arena).

        .. versionadded:: 0.4.0
        """
        return bool(self._mapped().table[index * ENTRY_WORDS] == READY)

    @property
    def following(self) -> bool:
        """Whether the arena follows a shard (:meth:`follow`): then it evicts, and :meth:`lookup` copies.

        .. versionadded:: 0.4.0
        """
        return bool(self._mapped().header[H_FOLLOW])

    def reserve(self, index: int, nbytes: int, page_offset: int | None = None) -> int | None:
        """Hand out ``nbytes`` of the data area for ``index``; ``None`` if it is already published or no room.

        The range starts at a multiple of 64 bytes or, with ``page_offset`` (a multiple of 64), ``page_offset``
        bytes before a page boundary of the file (see :attr:`~ignite_ext.data.cache.codec.Encoded.page_offset`).
        """
        local = self._mapped()
        header = local.header
        size = aligned(nbytes)
        if header[H_FOLLOW]:
            return self._reserve_following(local, index, size)
        if local.table[index * ENTRY_WORDS] != EMPTY or header[H_USED] + size > header[H_CAPACITY]:
            return None  # checked without the lock first, so a full cache costs no lock per miss
        with self._locked(local):
            if header[H_FOLLOW]:  # another process made it follow since the check above: its tail is reusable
                return self._take_following(local, index, size)
            offset = header[H_USED]
            if page_offset is not None:  # the data area starts on a page: offsets in it are file offsets mod PAGE
                offset += (-(offset + page_offset)) % PAGE
            if local.table[index * ENTRY_WORDS] != EMPTY or offset + size > header[H_CAPACITY]:
                return None
            try:
                # Reserve the pages now: writing to a hole of a full tmpfs would kill this process with SIGBUS.
                os.posix_fallocate(local.arena_fd, header[H_DATA] + offset, size)
            except OSError:
                header[H_FULL] = 1
                return None
            header[H_USED] = offset + size
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
        base = index * ENTRY_WORDS
        if local.cow is None or local.table[base] != READY:
            return None
        offset = local.table[base + 1]
        if local.header[H_FOLLOW]:  # asked after the entry is read, as in lookup(): a range that may be reused
            return None
        return local.cow.lend(local.header[H_DATA] + offset + start, nbytes)

    def _space(self, local: Local) -> FollowSpace | None:
        """The bookkeeping of a following arena (see :mod:`~ignite_ext.data.cache._follow`), or None."""
        follow = int(local.header[H_FOLLOW])
        if not follow:
            return None
        if local.follow is None:
            local.follow = FollowSpace(local.mm, int(local.header[H_DATA]) + follow - 1, int(local.header[H_N]))
        return local.follow  # type: ignore[no-any-return]

    def _reserve_following(self, local: Local, index: int, size: int) -> int | None:
        """:meth:`reserve` in a following arena: the first free range that fits, else the unused tail."""
        if local.table[index * ENTRY_WORDS] != EMPTY or local.header[H_FULL]:
            return None  # full since the last eviction (which clears the flag): no lock per miss
        with self._locked(local):
            return self._take_following(local, index, size)

    def _take_following(self, local: Local, index: int, size: int) -> int | None:
        """:meth:`_reserve_following`'s work, under the lock: the range, recorded as being written by this process."""
        header = local.header
        space = self._space(local)
        if space is None or local.table[index * ENTRY_WORDS] != EMPTY:
            return None
        offset = space.take(size)
        if offset is None:
            offset = int(header[H_USED])
            if offset + size > header[H_CAPACITY]:
                header[H_FULL] = 1
                return None
            try:
                os.posix_fallocate(local.arena_fd, header[H_DATA] + offset, size)  # see reserve()
            except OSError:
                header[H_FULL] = 1
                return None
            header[H_USED] = offset + size
        if not space.hold(local.pid, offset, size):
            return None  # every in-flight slot is a live writer's: the range comes back at the next eviction
        return offset

    def abandon(self, offset: int) -> None:
        """Give up a range reserved at ``offset`` and not published (a following arena reuses it after an eviction).

        .. versionadded:: 0.4.0
        """
        local = self._mapped()
        with self._locked(local):
            if (space := self._space(local)) is not None:
                space.release(local.pid, offset)

    def follow(self, keep: Iterable[int] | Any) -> Followed:
        """Keep the entries of ``keep`` (indices) only: evict the others and hand their space to new samples.

        The first call makes the arena *following* (see the module docstring): it takes a bookkeeping region of
        ``16 * n`` bytes of the data area plus 10 KiB (without room for it nothing is evicted and ``following``
        stays False), and what is stored by then is never moved nor its space reused. A call with the set of the
        call before evicts nothing and costs no lock. Any process of the node may call it; the others see its
        effect at once.

        Args:
            keep: the indices to keep (any iterable of ints, or an integer array).

        Returns:
            How many entries were evicted, their bytes, and whether the arena follows.

        Raises:
            ValueError: an index is not in ``range(n)``.

        Examples:
            >>> from ignite_ext.data.cache.arena import Arena
            >>> arena = Arena.create(n=3, capacity=1 << 20)
            >>> arena.follow([0, 1, 2]).following
            True
            >>> for index in (0, 1):
            ...     offset = arena.reserve(index, 100)
            ...     arena.data_view(offset, 100)[:] = bytes([index]) * 100
            ...     arena.publish(index, offset, 100)
            True
            True
            >>> arena.follow([1, 2])  # index 0 left: evicted, its 128 bytes go to the next sample stored
            Followed(evicted=1, evicted_bytes=100, following=True)
            >>> arena.lookup(0) is None, arena.reserve(2, 100) == offset - 128
            (True, True)
            >>> arena.close()

        .. versionadded:: 0.4.0
        """
        import numpy as np

        local = self._mapped()
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
        with self._locked(local):
            space = self._space(local) or self._start_following(local, n)
            if space is None:
                return Followed(0, 0, False)
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

    def _start_following(self, local: Local, n: int) -> FollowSpace | None:
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
        return self._space(local)

    def lender(self, index: int, raw: memoryview) -> Callable[[int, int], memoryview | None]:
        """What lends the large buffers of ``raw`` (the bytes :meth:`lookup` returned for ``index``) to a decoder.

        A private copy (a following arena's) lends slices of itself; a view of the arena, :meth:`borrow`.

        .. versionadded:: 0.4.0
        """
        if isinstance(raw.obj, bytearray):
            return lambda start, nbytes: raw[start : start + nbytes]
        return functools.partial(self.borrow, index)

    def data_view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of a reserved range."""
        return self._mapped().data[offset : offset + nbytes]

    def publish(self, index: int, offset: int, nbytes: int) -> bool:
        """Make a fully written range the entry of ``index``; ``False`` if another writer published it first."""
        local = self._mapped()
        base = index * ENTRY_WORDS
        with self._locked(local):
            if (space := self._space(local)) is not None:
                space.release(local.pid, offset)
            if local.table[base] != EMPTY:
                return False
            local.table[base + 1] = offset
            local.table[base + 2] = nbytes
            local.table[base] = READY  # last: readers take READY to mean complete
        return True

    def count(
        self,
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
            own = local.claimed[row] = self._claim(local, row, slot)
        base = (row * SLOTS_PER_ROW + own) * SLOT_WORDS
        words = local.stats
        # In its own slot this process is the only writer: its threads need only exclude each other. A hit (the
        # call of every cached read) touches its one word.
        with local.thread_lock if own != SHARED_SLOT else self._locked(local):
            words[base + HITS] += hits
            if misses or entries or nbytes or evictions or evicted_bytes or loaded_ahead:
                words[base + MISSES] += misses
                words[base + ENTRIES] += entries
                words[base + BYTES] += nbytes
                words[base + EVICTIONS] += evictions
                words[base + EVICTED_BYTES] += evicted_bytes
                words[base + LOADED_AHEAD] += loaded_ahead

    def _claim(self, local: Local, row: int, slot: int) -> int:
        if not 0 <= slot < SHARED_SLOT:
            return SHARED_SLOT
        owner_word = (row * SLOTS_PER_ROW + slot) * SLOT_WORDS + OWNER
        with self._locked(local):
            owner = local.stats[owner_word]
            if owner not in (0, local.pid) and pid_alive(owner):
                return SHARED_SLOT  # e.g. two DataLoaders of one rank iterating at once: same worker ids
            local.stats[owner_word] = local.pid
        return slot

    def totals(self, row: int) -> tuple[int, int, int, int, int, int, int]:
        """``(hits, misses, entries, bytes, evictions, evicted_bytes, loaded_ahead)`` of ``row``, over its processes."""
        words = self._mapped().stats
        sums = [0] * 7
        for slot in range(SLOTS_PER_ROW):
            base = (row * SLOTS_PER_ROW + slot) * SLOT_WORDS
            for k, word in enumerate((HITS, MISSES, ENTRIES, BYTES, EVICTIONS, EVICTED_BYTES, LOADED_AHEAD)):
                sums[k] += words[base + word]
        return sums[0], sums[1], sums[2], sums[3], sums[4], sums[5], sums[6]

    def discard(self) -> None:
        """:meth:`close`, and delete the files also where they would be kept (a persisted cache found stale)."""
        path = self.path
        self.close()
        remove_files([path, path[: -len(".arena")] + ".lock"])

    def close(self) -> None:
        """Unmap in this process and, in the creating process, delete the files (mappings elsewhere stay valid)."""
        if self._local is not None and self._local.pid == os.getpid():
            close_local(self._local)
        self._local = None
        if self._finalizer is not None:
            self._finalizer()
