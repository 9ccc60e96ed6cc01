"""An arena's file: its life (create, adopt, open persisted, attach, close) and the rules that keep it safe.

An arena is a plain file mapped by every process that reads the cache (in ``/dev/shm``: RAM, once per node)::

    header (4 KiB) | index table: n x (state, offset, length) | counters | data (64-byte aligned, from a page)

The lock is ``flock`` on a ``.lock`` file beside it: the kernel releases it when its holder dies, so a SIGKILLed
worker cannot wedge the others. The creator holds a shared ``flock`` on the arena for its whole life: with its pid
in the name (:mod:`~ignite_ext.data.cache.shm`), that tells a killed run's arena (swept, or adopted by a restarted
group: :mod:`~ignite_ext.data.cache.restart`) from one in use. A file this process did not create is checked
(:meth:`ArenaFile.consistent`) before any sample of it is served.

.. versionadded:: 0.5.0
   Out of :mod:`~ignite_ext.data.cache.arena` (0.1.0).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Self

from ignite_ext._fs import own_regular_file
from ignite_ext.data.cache import _mapping, _sigterm, restart, shm
from ignite_ext.data.cache._counters import restart_counters
from ignite_ext.data.cache._cow import PAGE
from ignite_ext.data.cache._follow import space_bytes
from ignite_ext.data.cache._mapping import (
    ALIGN,
    EMPTY,
    ENTRY_WORDS,
    H_AGENT,
    H_AGENT_ID,
    H_CAPACITY,
    H_DATA,
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
    MAGIC,
    READY,
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
from ignite_ext.data.cache._space import AppendOnly
from ignite_ext.data.cache.restart import NO_JOB, agent_stamp
from ignite_ext.data.cache.shm import MIN_CAPACITY, SHM_DIR, remove_files
from ignite_ext.errors import ShmSpaceError

__all__ = ["PERSISTED", "PERSIST_ROWS", "ArenaFile"]

#: The job stamp of a persisted cache (see .persist): no job's, since job stamps are digests.
PERSISTED = 1
#: Counter rows of a persisted cache at least: a later job may run more ranks per node than the first.
PERSIST_ROWS = 64


def _layout(n: int, rows: int) -> tuple[int, int, int]:
    """Where the index table, the counters and the data area start in an arena of ``n`` indices and ``rows`` rows."""
    table_off = HEADER_BYTES
    stats_off = aligned(table_off + n * ENTRY_WORDS * 8)
    return table_off, stats_off, aligned(stats_off + rows * SLOTS_PER_ROW * SLOT_WORDS * 8, PAGE)  # see borrow()


def _room(knob: str, directory: str) -> tuple[str, str]:
    """The place a cache's ``knob`` sizes, as its errors name it (RAM or the disk), and how to make room there."""
    if knob == "disk_bytes":
        return f"the disk directory {directory} (disk_dir)", f"free space in {directory}, or pass a roomier disk_dir"
    return f"RAM in {directory} (shared memory)", f"enlarge {directory} (e.g. docker run --shm-size=8g)"


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
    # Kept: a persisted cache (it outlives its job), and the arenas of an attempt that fails or is SIGTERMed with a
    # restart left (for the restarted group, as a SIGKILLed attempt leaves them).
    leaving = restart.leaving_for_a_restart(_sigterm.terminating(), _sigterm.replaced())
    if not keep and not (leaving and shm.agent_lives(path)):
        remove_files([path, path[: -len(".arena")] + ".lock"])
    with contextlib.suppress(OSError):
        os.close(liveness_fd)


class ArenaFile:
    """One arena file as this process holds it: made by :meth:`create`, attached by any other process of the node.

    Create it once (in the process that owns the cache) and :meth:`attach` it anywhere else. It pickles as its path
    only; a process that unpickles it maps the file on first use, and a forked process reopens its own lock
    descriptor (a ``flock`` shared with the parent would not exclude it).

    .. versionadded:: 0.5.0
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
        sweep: bool = True,
        job: int = NO_JOB,
        key: int = 0,
    ) -> Self:
        """Create an arena for ``n`` indices and ``capacity`` bytes of data; it is deleted when this process exits.

        In a restarted worker group, adopt instead the arena of the attempt before stamped with this ``job`` and
        ``key`` (:mod:`~ignite_ext.data.cache.restart`), its samples and capacity.

        Args:
            n: number of dataset indices.
            capacity: bytes of sample data; ``None`` takes :data:`~.shm.DEFAULT_FRACTION` of the free space, split
                ``share`` ways (the caches created together: the ranks of a node, each its own).
            rows: number of counter rows (one per rank sharing the arena).
            directory: a tmpfs (RAM), or a node-local disk for a disk tier.
            share: see ``capacity``.
            knob: the user's name of ``capacity`` (``"disk_bytes"``: a disk tier), for the errors (:func:`_room`).
            sweep: whether to sweep this user's stale arenas first and adopt one (not where other hosts mount).
            job: the job stamp (:func:`~.restart.job_key`); :data:`NO_JOB` adopts nothing and is never adopted.
            key: the cache stamp (:func:`~.restart.cache_key`).

        Raises:
            ShmSpaceError: the directory lacks room for the table plus ``capacity`` (or :data:`~.shm.MIN_CAPACITY`).
            ValueError: ``n`` is negative or ``capacity`` not positive.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"{knob} must be positive, got {capacity}")
        if not os.path.isdir(directory):
            raise ShmSpaceError(f"{directory} does not exist: the cache needs a tmpfs for shared memory")
        with shm.directory_lock(directory):  # concurrent creators must see each other's claims
            if sweep and job != NO_JOB and (adopted := cls._adopt(directory, n, rows, job, key)) is not None:
                return adopted
            if sweep:
                shm.sweep_stale(directory)
            return cls._create_locked(n, capacity, rows, directory, share, knob, job, key)

    @classmethod
    def _create_locked(
        cls,
        n: int,
        capacity: int | None,
        rows: int,
        directory: str,
        share: int,
        knob: str,
        job: int,
        key: int,
        stem: str | None = None,
    ) -> Self:
        """:meth:`create`'s work once the directory's creation lock is held; at ``stem`` (kept at exit) if given."""
        table_off, stats_off, data_off = _layout(n, rows)
        free = shm.available_bytes(directory)
        place, advice = _room(knob, directory)
        if capacity is None:
            # Arenas fill lazily: what live caches may still claim is not free for a new default.
            unclaimed = max(0, free - shm.promised_bytes(directory))
            capacity = int((unclaimed - data_off) * shm.DEFAULT_FRACTION / max(1, share)) // ALIGN * ALIGN
            if capacity < MIN_CAPACITY:
                raise ShmSpaceError(
                    f"{place} is full: {free} bytes free, {unclaimed} of them not promised to this user's other "
                    f"caches; a cache of {n} samples needs {data_off} bytes for its index plus at least "
                    f"{MIN_CAPACITY} for data: {advice}, or pass {knob}"
                )
        elif data_off + capacity > free:
            raise ShmSpaceError(
                f"{place} is too small: {knob}={capacity} plus {data_off} bytes of index exceed the {free} bytes "
                f"free there; lower {knob} or {advice}"
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
            self._local.space = AppendOnly
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
    ) -> tuple[Self | None, bool]:
        """This user's persisted arena ``key`` in ``directory`` (see :mod:`~ignite_ext.data.cache.persist`).

        Opened when a sound one is there (True), else created (False: one that fails its checks is deleted, with a
        :class:`~ignite_ext.data.cache.persist.StaleCacheWarning`); kept at exit; its use recorded, the user's
        persisted caches brought under their cap. ``(None, False)`` when another user's file (or a link) has the
        name: never opened nor deleted.

        Raises:
            ShmSpaceError: there is no room for it in ``directory``.

        .. versionadded:: 0.3.0
        """
        from ignite_ext.data.cache import persist

        stem = persist.persisted_stem(directory, key)
        path = stem + ".arena"
        rows = max(rows, PERSIST_ROWS)  # a later job may run more ranks per node
        with shm.directory_lock(directory):
            opened: Self | None = None
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
                opened = cls._create_locked(n, capacity, rows, directory, 1, knob, PERSISTED, key, stem=stem)
            os.utime(stem + ".lock", follow_symlinks=False)  # its last use, for the eviction of the least recent
            persist.evict(directory, keep=path, cap=persist.persist_cap(directory))
        return opened, adopted

    @classmethod
    def _open_persisted(cls, path: str, n: int, rows: int, key: int) -> tuple[Self | None, str]:
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
            restart_counters(self._mapped(), found_rows)
        return self, ""

    @classmethod
    def _held_checked(cls, path: str, keep: bool) -> tuple[Self, str | None]:
        """``path`` held (:meth:`_held`), mapped and checked (:meth:`consistent`): the arena, and what is wrong."""
        self = cls._held(path, keep)
        try:
            self._mapped()
            return self, self.consistent()
        except (OSError, RuntimeError, ValueError) as exc:
            return self, f"it cannot be mapped ({exc})"

    @classmethod
    def _held(cls, path: str, keep: bool) -> Self:
        """``path`` as this process's own arena: its liveness lock held, deleted at exit unless ``keep``."""
        liveness_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        fcntl.flock(liveness_fd, fcntl.LOCK_SH)
        self = cls(path)
        self._finalizer = weakref.finalize(self, _finalize, path, os.getpid(), liveness_fd, keep)
        if not keep:
            _sigterm.register(self._finalizer)
        return self

    @classmethod
    def _adopt(cls, directory: str, n: int, rows: int, job: int, key: int) -> Self | None:
        """The stale arena of ``directory`` stamped ``job`` and ``key``, made this process's own, or None.

        None also when the arena found fails :meth:`consistent` (then it is deleted). Called under the user's
        creation lock of ``directory``, which every sweep holds too. The creator's workers may linger (seconds): they
        only ever publish complete samples of the same dataset.
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
                    f"the cache kept in {directory} from the job's run before its restart was not reused: {problem}; "
                    "this run's cache starts empty",
                    RuntimeWarning,
                    stacklevel=7,  # the user's construction of the cache (see tiers.open_tiers)
                )
                self.close()
                return None
            restart_counters(self._mapped(), rows)
            # This run's agent from now on: a requeued Slurm job's run count, which tells its own end from a requeue.
            header = self._mapped().header
            header[H_AGENT], header[H_AGENT_ID] = agent_stamp()
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
    def attach(cls, path: str) -> Self:
        """Map an existing arena (created by another process of this node); never deletes it."""
        self = cls(path)
        self._mapped()
        return self

    def __reduce__(self) -> tuple[type[Self], tuple[str, Origin | None]]:
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
        local.space = AppendOnly  # until this process sees it follow (see ._space)
        self._local = local
        return local

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
