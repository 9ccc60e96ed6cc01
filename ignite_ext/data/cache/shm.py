"""The shared-memory directory that caches live in: free space, what live caches may still claim, stale arenas.

Arenas are named ``ignite_ext_<pid>_cache_<random>.arena`` (with a ``.lock`` beside), ``<pid>`` being the process
that created the cache: with the liveness ``flock`` that process holds on it, that is how :func:`sweep_stale` tells
an arena left by a killed run from one in use.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterable, Iterator

from ignite_ext._fs import pid_alive
from ignite_ext.errors import ShmSpaceError

__all__ = [
    "DEFAULT_FRACTION",
    "MIN_CAPACITY",
    "NAME_RE",
    "SHM_DIR",
    "ShmSpaceError",
    "available_bytes",
    "directory_lock",
    "mapped_pss",
    "promised_bytes",
    "remove_files",
    "sweep_stale",
]

#: Where arenas live: a tmpfs, so their pages are RAM shared by every process that maps them.
SHM_DIR = "/dev/shm"
#: Share of the free space of :data:`SHM_DIR` that a cache takes by default.
DEFAULT_FRACTION = 0.5
#: Smallest data capacity worth creating a cache for.
MIN_CAPACITY = 1 << 20
#: The names of arenas and their lock files; group 1 is the creating pid.
NAME_RE = re.compile(r"^ignite_ext_(\d+)_cache_[0-9a-f]+\.(arena|lock)$")


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
    """Bytes that the cache arenas in ``directory`` may still allocate: their capacity not yet backed by pages.

    Examples:
        >>> import os, tempfile
        >>> from ignite_ext.data.cache.arena import Arena
        >>> from ignite_ext.data.cache.shm import SHM_DIR, promised_bytes
        >>> directory = tempfile.mkdtemp(dir=SHM_DIR)
        >>> arena = Arena.create(n=1, capacity=1 << 20, directory=directory)
        >>> promised_bytes(directory) > 1_000_000  # the whole data area: no sample stored yet
        True
        >>> arena.close()
        >>> os.rmdir(directory)

    .. versionadded:: 0.1.0
    """
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(".arena") and NAME_RE.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    total += max(0, st.st_size - st.st_blocks * 512)
    return total


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Delete the arenas (and lock files) of caches whose creating process is gone; return the removed paths.

    An arena is only removed when both its creator pid is dead and nobody holds its liveness lock, so an arena
    of a live process (also one in another pid namespace sharing this tmpfs) is never touched.

    Examples:
        >>> from ignite_ext.data.cache.shm import sweep_stale
        >>> isinstance(sweep_stale(), list)
        True

    .. versionadded:: 0.1.0
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    me = os.getpid()
    for name in sorted(names):
        match = NAME_RE.match(name)
        if match is None or int(match.group(1)) == me or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        if match.group(2) == "arena":
            if not _unused(path):
                continue
            removed += remove_files([path, path[: -len(".arena")] + ".lock"])
        elif not os.path.exists(path[: -len(".lock")] + ".arena"):
            removed += remove_files([path])
    return removed


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` itself (no lock file to leave behind; released if we die)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
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


def _unused(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_files(paths: Iterable[str]) -> list[str]:
    """Delete ``paths``; return those this call deleted (the others were gone already).

    Examples:
        >>> from ignite_ext.data.cache.shm import remove_files
        >>> remove_files(["/nonexistent/a"])
        []

    .. versionadded:: 0.2.0
    """
    done = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            done.append(path)
    return done


def mapped_pss(path: str, pids: Iterable[int]) -> int:
    """Sum, over ``pids``, of the proportional set size (bytes) of their mappings of ``path``.

    Shared pages count ``1/k`` in each of the ``k`` processes mapping them, so the sum is the memory the file's
    mapped pages really take, however many processes map it.

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
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total
