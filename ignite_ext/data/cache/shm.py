"""The directory that caches live in (``/dev/shm``, or a disk tier's): free space, claims, stale arenas.

Arenas are named ``ignite_ext_<uid>_<pid>_cache_<random>.arena`` (with a ``.lock`` beside): with the liveness
``flock`` their creator holds, that is how :func:`sweep_stale` tells a killed run's arena from one in use. Anyone
may create a file of any name here, so only the caller's own files count: named with its user id *and* owned by
it, regular, never through a link (see the cache guide's *Other users*). Creations take turns on the user's
creation lock, ``ignite_ext_<uid>.lock``, an empty file left in place (deleting a lock file others may be opening
would let two of them hold it); where another user took that name, creation goes ahead without it.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator

from ignite_ext._fs import pid_alive
from ignite_ext.data.cache import restart
from ignite_ext.data.cache._mapping import H_AGENT, H_AGENT_ID, H_MAGIC, H_VERSION, MAGIC, VERSION
from ignite_ext.errors import ShmSpaceError

# fmt: off
__all__ = [
    "DEFAULT_FRACTION", "MIN_CAPACITY", "NAME_RE", "SHM_DIR", "ShmSpaceError", "agent_lives", "arena_stem",
    "available_bytes", "directory_lock", "header_words", "mapped_pss", "orphaned_arenas", "own_files",
    "promised_bytes", "remove_files", "stale_arenas", "sweep_stale", "unused",
]
# fmt: on

#: Where arenas live: a tmpfs, so their pages are RAM shared by every process that maps them.
SHM_DIR = "/dev/shm"
#: Share of the free space of :data:`SHM_DIR` that a cache takes by default.
DEFAULT_FRACTION = 0.5
#: Smallest data capacity worth creating a cache for.
MIN_CAPACITY = 1 << 20
#: The names of arenas and their lock files: the creating user's id, the creating pid, the kind of file. Names
#: without the user id are those of version 0.1 (still swept, when they are the user's own files).
NAME_RE = re.compile(r"^ignite_ext_(?:(?P<uid>\d+)_)?(?P<pid>\d+)_cache_[0-9a-f]+\.(?P<kind>arena|lock)$")


def arena_stem(directory: str) -> str:
    """A fresh path, without suffix, for an arena of this user and process in ``directory``.

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.shm import NAME_RE, arena_stem
        >>> found = NAME_RE.match(os.path.basename(arena_stem("/dev/shm")) + ".arena")
        >>> int(found["uid"]) == os.geteuid() and int(found["pid"]) == os.getpid()
        True

    .. versionadded:: 0.2.0
    """
    return os.path.join(directory, f"ignite_ext_{os.geteuid()}_{os.getpid()}_cache_{secrets.token_hex(8)}")


def own_files(directory: str, names: re.Pattern[str] = NAME_RE) -> list[tuple[str, re.Match[str], os.stat_result]]:
    """This user's files in ``directory`` whose names match ``names``: name, match, ``lstat``; nobody else's.

    Examples:
        >>> from ignite_ext.data.cache.shm import own_files
        >>> own_files("/nonexistent")
        []

    .. versionadded:: 0.5.0
    """
    uid = os.geteuid()
    found = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            match = names.match(entry.name)
            if match is None or (match["uid"] is not None and int(match["uid"]) != uid):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:  # a forger can choose the name, not the owner
                found.append((entry.name, match, st))
    return found


def _open_own(path: str, flags: int) -> int | None:
    """Open ``path`` if it is a regular file of this user's (never through a link), else None."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    return None


def available_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``.

    Examples:
        >>> from ignite_ext.data.cache.shm import available_bytes
        >>> available_bytes() > 0
        True

    .. versionadded:: 0.1.0
    """
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def promised_bytes(directory: str = SHM_DIR) -> int:
    """Bytes that this user's cache arenas in ``directory`` may still allocate: their capacity not yet backed by pages.

    Other users' arenas are not counted: what they fill is free space gone (then samples are served uncached).

    Examples:
        >>> import shutil, tempfile
        >>> from ignite_ext.data.cache.arena import Arena
        >>> from ignite_ext.data.cache.shm import SHM_DIR, promised_bytes
        >>> directory = tempfile.mkdtemp(dir=SHM_DIR)
        >>> arena = Arena.create(n=1, capacity=1 << 20, directory=directory)
        >>> promised_bytes(directory) > 1_000_000  # the whole data area: no sample stored yet
        True
        >>> arena.close()
        >>> shutil.rmtree(directory)

    .. versionadded:: 0.1.0
    """
    return sum(
        max(0, st.st_size - st.st_blocks * 512) for _, match, st in own_files(directory) if match["kind"] == "arena"
    )


def orphaned_arenas(directory: str = SHM_DIR) -> list[str]:
    """This user's arenas in ``directory`` whose creating process does not run (in this pid namespace).

    Processes it forked (DataLoader workers, which end within seconds of their parent) may still map them.

    Examples:
        >>> from ignite_ext.data.cache.shm import orphaned_arenas
        >>> isinstance(orphaned_arenas(), list)
        True

    .. versionadded:: 0.3.0
    """
    me = os.getpid()
    return [
        os.path.join(directory, name)
        for name, match, _ in own_files(directory)
        if match["kind"] == "arena" and int(match["pid"]) != me and not pid_alive(int(match["pid"]))
    ]


def stale_arenas(directory: str = SHM_DIR) -> list[str]:
    """The :func:`orphaned_arenas` whose liveness lock nobody holds: no process uses them any more.

    Examples:
        >>> from ignite_ext.data.cache.shm import stale_arenas
        >>> isinstance(stale_arenas(), list)
        True

    .. versionadded:: 0.3.0
    """
    return [path for path in orphaned_arenas(directory) if unused(path)]


def header_words(path: str, count: int) -> tuple[int, ...] | None:
    """The first ``count`` 8-byte words of this user's file ``path`` (never through a link); None if unreadable.

    Examples:
        >>> import tempfile
        >>> from ignite_ext.data.cache.shm import header_words
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write((7).to_bytes(8, "little") + (9).to_bytes(8, "little"))
        ...     f.flush()
        ...     header_words(f.name, 2), header_words(f.name, 3)
        ((7, 9), None)

    .. versionadded:: 0.3.0
    """
    fd = _open_own(path, os.O_RDONLY)
    if fd is None:
        return None
    try:
        raw = os.pread(fd, 8 * count, 0)
    finally:
        os.close(fd)
    if len(raw) < 8 * count:
        return None
    return tuple(int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(count))


def agent_lives(path: str) -> bool:
    """Whether this user's arena ``path`` is stamped with an elastic job's agent that still runs on this host.

    Such an arena waits for the job's restarted worker group (see :mod:`~ignite_ext.data.cache.restart`).

    Examples:
        >>> from ignite_ext.data.cache.shm import agent_lives
        >>> agent_lives("/nonexistent.arena")
        False

    .. versionadded:: 0.4.0
    """
    words = header_words(path, H_AGENT_ID + 1)
    if words is None or words[H_MAGIC] != MAGIC or words[H_VERSION] != VERSION:
        return False
    return restart.agent_lives(words[H_AGENT], words[H_AGENT_ID])


def sweep_stale(directory: str = SHM_DIR, keep: Callable[[str], bool] | None = None) -> list[str]:
    """Delete this user's arenas (and lock files) of caches whose creating process is gone; return the removed paths.

    Removed only when its creator pid is dead and nobody holds its liveness lock (so never a live process's, even
    in another pid namespace), and it is not left for a restarted group (:func:`agent_lives`) or ``keep(path)``.

    Examples:
        >>> from ignite_ext.data.cache.shm import sweep_stale
        >>> isinstance(sweep_stale(), list)
        True

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.3.0
       ``keep``.
    .. versionchanged:: 0.4.0
       The arenas of every job whose agent lives are left, not only the sweeping job's own.
    """
    removed: list[str] = []
    for path in stale_arenas(directory):
        if not agent_lives(path) and (keep is None or not keep(path)):
            removed += remove_files([path, path[: -len(".arena")] + ".lock"])
    me = os.getpid()
    for name, match, _ in own_files(directory):
        path = os.path.join(directory, name)
        pid = int(match["pid"])
        orphan = match["kind"] == "lock" and not os.path.lexists(path[: -len(".lock")] + ".arena")
        if orphan and pid != me and not pid_alive(pid):
            removed += remove_files([path])
    return removed


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Hold this user's creation lock of ``directory``: an exclusive ``flock`` on its ``ignite_ext_<uid>.lock``.

    The kernel releases it if the holder dies. If that name is another user's (or cannot be opened), the block
    runs without the lock: creations at the same moment may then size their defaults without seeing each other.
    """
    fd = _open_own(os.path.join(directory, f"ignite_ext_{os.geteuid()}.lock"), os.O_RDWR | os.O_CREAT)
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # Explicitly: a process forked meanwhile (another thread's DataLoader) shares the descriptor's lock,
            # and closing our descriptor alone would leave it held until that process exits.
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def unused(path: str) -> bool:
    """Whether no process holds the liveness lock (a ``flock``) of this user's arena ``path``.

    Examples:
        >>> from ignite_ext.data.cache.shm import unused
        >>> unused("/nonexistent.arena")
        False

    .. versionadded:: 0.3.0
    """
    fd = _open_own(path, os.O_RDONLY)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: its creator (or a process it forked) still holds it
        return False
    finally:
        os.close(fd)
    return True


def remove_files(paths: Iterable[str]) -> list[str]:
    """Delete ``paths``; return those this call deleted (the others were gone already, or cannot be deleted).

    Examples:
        >>> from ignite_ext.data.cache.shm import remove_files
        >>> remove_files(["/nonexistent/a"])
        []

    .. versionadded:: 0.2.0
    """
    done = []
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
            done.append(path)
    return done


def mapped_pss(path: str, pids: Iterable[int]) -> int:
    """Sum, over ``pids``, of the proportional set size (bytes) of their mappings of ``path``.

    Shared pages count ``1/k`` in each of the ``k`` processes mapping them: the sum is what they really take.

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.shm import mapped_pss
        >>> mapped_pss("/nonexistent", [os.getpid()])
        0

    .. versionadded:: 0.1.0
    """
    total = 0
    for pid in pids:
        inside = False
        try:
            with open(f"/proc/{pid}/smaps") as f:
                for line in f:
                    if not line[0].isupper():  # a mapping's first line starts with its hex address range
                        inside = line.rstrip("\n").endswith(" " + path)
                    elif inside and line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):  # gone, or another user's: counts 0
            continue
    return total
