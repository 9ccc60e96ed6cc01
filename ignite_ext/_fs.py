"""File helpers that downloads, extraction and the cache share: locks, durable renames, atomic JSON, orphans.

Standard library only, and ``fcntl`` is imported only when a lock is taken (where it is missing, Windows, the lock
is :mod:`filelock`'s), so the download path imports on every platform.

Who made a file is part of its name: ``<host>.<pid>.<random>`` (:func:`owner_tag`). A later scan
(:func:`orphans`) tells from that name whether its writer is gone: a pid of this host that no longer runs, or, for
another host (whose pids cannot be checked), a file left untouched for a given age.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "OWNER",
    "WAIT_LOG_INTERVAL_S",
    "Lock",
    "RecordLock",
    "exclusive",
    "fsync_dir",
    "holder",
    "host",
    "idle",
    "listdir",
    "orphans",
    "own_regular_file",
    "owner_gone",
    "owner_tag",
    "pid_alive",
    "read_json",
    "sidecar_stem",
    "unlink",
    "write_json",
]

#: ``host.pid.random`` in a file name: whoever made it, so that a scan can tell whether that writer still lives.
OWNER = r"(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]{8})"


def pid_alive(pid: int) -> bool:
    """Return whether ``pid`` runs on this host; a zombie (killed, not yet reaped) counts as dead.

    Args:
        pid: a process id of this host.

    Returns:
        False when no such process runs (or it is a zombie), True otherwise (also for another user's process).

    Examples:
        >>> import os
        >>> from ignite_ext._fs import pid_alive
        >>> pid_alive(os.getpid())
        True

    .. versionadded:: 0.2.0
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:  # a killed child that its parent has not reaped yet is a zombie: it will never write again
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def host() -> str:
    """This host's name, reduced to the characters :data:`OWNER` allows.

    Examples:
        >>> import re
        >>> from ignite_ext._fs import host
        >>> bool(re.fullmatch(r"[A-Za-z0-9-]+", host()))
        True

    .. versionadded:: 0.2.0
    """
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"


def owner_tag() -> str:
    """``host.pid.random``: unique to this writer, and tells a later scan whether the writer still lives.

    Examples:
        >>> import re
        >>> from ignite_ext._fs import OWNER, owner_tag
        >>> bool(re.fullmatch(OWNER, owner_tag()))
        True

    .. versionadded:: 0.2.0
    """
    return f"{host()}.{os.getpid()}.{secrets.token_hex(4)}"


#: Names longer than this (in UTF-8 bytes) are shortened in the names of the files kept beside them.
SIDECAR_NAME_MAX = 120


def sidecar_stem(name: str) -> str:
    """``name`` as it appears in the names of the files kept beside it (locks, records, temp files).

    Those names add up to ~70 bytes to it, so a long name is cut and made unique with a hash: every sidecar name
    stays under the 255 bytes filesystems allow.

    Examples:
        >>> from ignite_ext._fs import sidecar_stem
        >>> sidecar_stem("data.tar.gz")
        'data.tar.gz'
        >>> stem = sidecar_stem("x" * 240 + ".bin")
        >>> len(stem.encode()), stem.startswith("x" * 60), stem == sidecar_stem("x" * 240 + ".bin")
        (77, True, True)

    .. versionadded:: 0.2.0
    """
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= SIDECAR_NAME_MAX:
        return name
    head = raw[:60].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:16]}"


def own_regular_file(path: Path) -> bool:
    """Whether ``path`` itself (not what a link points to) is a regular file owned by this process's user.

    What another user of a shared folder plants (a symlink, a fifo, a file of theirs) is never taken over.

    Examples:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import own_regular_file
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     mine = Path(tmp, "mine")
        ...     _ = mine.write_text("x")
        ...     os.symlink(mine, Path(tmp, "link"))
        ...     own_regular_file(mine), own_regular_file(Path(tmp, "link")), own_regular_file(Path(tmp, "none"))
        (True, False, False)

    .. versionadded:: 0.2.0
    """
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (not hasattr(os, "geteuid") or st.st_uid == os.geteuid())


def idle(path: Path, max_age_s: float) -> bool:
    """Whether ``path`` exists and was untouched for ``max_age_s``: the only sign of death for another host's writer.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import idle
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     idle(Path(f.name), 3600.0), idle(Path(f.name), -1.0)
        (False, True)

    .. versionadded:: 0.2.0
    """
    try:
        return time.time() - path.stat().st_mtime > max_age_s
    except FileNotFoundError:
        return False


def owner_gone(match: re.Match[str], path: Path, max_age_s: float) -> bool:
    """Whether the writer named in ``match`` (of :data:`OWNER`) can no longer touch ``path``.

    Examples:
        >>> import re, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import OWNER, owner_gone, owner_tag
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     owner_gone(re.fullmatch(OWNER, owner_tag()), Path(f.name), 3600.0)  # this very process
        False

    .. versionadded:: 0.2.0
    """
    # On Windows os.kill(pid, 0) would send CTRL_C_EVENT, so only the idle-age rule applies there.
    if match["host"] == host() and os.name != "nt":
        return not pid_alive(int(match["pid"]))
    return idle(path, max_age_s)


def listdir(directory: Path) -> list[str]:
    """The names in ``directory``, or none when it cannot be listed.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import listdir
        >>> listdir(Path("/nonexistent"))
        []

    .. versionadded:: 0.2.0
    """
    try:
        return os.listdir(directory)
    except OSError:
        return []


def orphans(directory: Path, pattern: re.Pattern[str], max_age_s: float) -> Iterator[tuple[Path, re.Match[str]]]:
    r"""Entries of ``directory`` named like ``pattern`` (which holds :data:`OWNER`) whose writer is gone.

    Examples:
        >>> import re, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import OWNER, host, orphans
        >>> with tempfile.TemporaryDirectory() as tmp:  # a temp file of a pid that does not run on this host
        ...     _ = Path(tmp, f"x.{host()}.999999999.0123abcd.tmp").write_text("")
        ...     [p.name.split(".")[2] for p, _ in orphans(Path(tmp), re.compile(rf"x\.{OWNER}\.tmp"), 3600.0)]
        ['999999999']

    .. versionadded:: 0.2.0
    """
    for name in listdir(directory):
        match = pattern.fullmatch(name)
        if match is not None and owner_gone(match, directory / name, max_age_s):
            yield directory / name, match


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import fsync_dir
        >>> fsync_dir(Path(tempfile.gettempdir()))

    .. versionadded:: 0.2.0
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unlink(*paths: Path) -> None:
    """Delete ``paths``; those already gone are fine.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import unlink
        >>> unlink(Path("/nonexistent/a"), Path("/nonexistent/b"))

    .. versionadded:: 0.2.0
    """
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import read_json
        >>> read_json(Path("/nonexistent.json")) is None
        True

    .. versionadded:: 0.2.0
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically with ``value`` as JSON (readers see the old or the new record, never a torn one).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import read_json, write_json
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_json(Path(tmp, "r.json"), {"a": 1})
        ...     read_json(Path(tmp, "r.json"))
        {'a': 1}

    .. versionadded:: 0.2.0
    """
    temp = path.with_name(f"{path.name}.{owner_tag()}.tmp")
    try:
        temp.write_text(json.dumps(value, sort_keys=True), encoding="utf-8")
        os.replace(temp, path)
    finally:
        unlink(temp)


class Lock(Protocol):
    """What :func:`exclusive` needs of a lock.

    .. versionadded:: 0.2.0
    """

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` return False at once instead of waiting."""

    def release(self) -> None:
        """Give the lock back."""


class RecordLock:
    """An exclusive POSIX record lock (``fcntl``) on a whole lock file; the kernel drops it with its holder.

    Record locks are the kind that network and cluster filesystems make coherent across hosts: NFS (through its
    lock manager; ``flock`` is emulated with them since Linux 2.6.12), GPFS (whose ``flock`` is node-local), Lustre
    mounted with ``-o flock``. ``flock`` would only exclude the processes of one node there. A record lock belongs to
    a process, not to a descriptor, so the threads of one process queue on a :class:`threading.Lock` first, and the
    file is opened once per process and never closed while held (closing any descriptor of it would drop the lock).
    It is not inherited by ``fork``. Where ``fcntl`` is missing (Windows), :mod:`filelock` locks instead.

    While held, the file says who holds it (``host pid``), for the messages of those who wait.

    Args:
        path: the lock file; created if missing, left in place.

    Examples:
        >>> import os, tempfile
        >>> from ignite_ext._fs import RecordLock
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     lock = RecordLock(os.path.join(tmp, ".x.lock"))
        ...     lock.acquire(), RecordLock(os.path.join(tmp, ".x.lock")).acquire(blocking=False)
        ...     lock.release()
        (True, False)

    .. versionadded:: 0.2.0
    """

    _threads: dict[str, threading.Lock] = {}
    #: The lock files this process holds: nothing in this process may open (and close) them meanwhile.
    held: set[str] = set()
    _guard = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self._key = os.path.abspath(path)
        with RecordLock._guard:
            self._thread_lock = RecordLock._threads.setdefault(self._key, threading.Lock())
        self._fd = -1
        self._filelock: Any = None

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` return False at once when another thread or process holds it."""
        if not self._thread_lock.acquire(blocking):
            return False
        try:
            import fcntl
        except ImportError:
            return self._acquire_without_fcntl(blocking)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except BaseException:
            self._thread_lock.release()
            raise
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._thread_lock.release()
            return False
        except BaseException:
            os.close(fd)
            self._thread_lock.release()
            raise
        self._fd = fd
        RecordLock.held.add(self._key)
        with contextlib.suppress(OSError):  # who holds it, for the waiters' messages (best effort)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        return True

    def _acquire_without_fcntl(self, blocking: bool) -> bool:
        import filelock

        lock = filelock.FileLock(self.path, is_singleton=True)
        try:
            lock.acquire(timeout=-1 if blocking else 0)
        except filelock.Timeout:
            self._thread_lock.release()
            return False
        self._filelock = lock
        return True

    def release(self) -> None:
        """Give the lock back (to the next process, then to the next thread of this one)."""
        try:
            if self._fd >= 0:
                import fcntl

                RecordLock.held.discard(self._key)
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)
                    fcntl.lockf(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = -1
            elif self._filelock is not None:
                self._filelock.release()
                self._filelock = None
        finally:
            self._thread_lock.release()


def holder(lock_path: Path) -> str | None:
    """Who holds the lock on ``lock_path`` (``"host pid"``), as its holder wrote it; None when unknown.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import holder
        >>> holder(Path("/nonexistent.lock")) is None
        True

    .. versionadded:: 0.2.0
    """
    if os.path.abspath(lock_path) in RecordLock.held:
        # Opening and closing the file here would drop this process's own record lock on it.
        return f"{socket.gethostname()} {os.getpid()}"
    try:
        with open(lock_path, "rb") as f:
            text = f.read(256).decode("utf-8", "replace").strip()
    except OSError:
        return None
    return text or None


#: Makes the lock :func:`exclusive` takes; tests replace it by one that never excludes anyone, to check that
#: correctness does not rest on the lock.
lock_factory: Callable[[str], Lock] = RecordLock
#: Seconds between two "still waiting" lines of a process waiting for a lock.
WAIT_LOG_INTERVAL_S = 5.0


@contextlib.contextmanager
def exclusive(lock_path: Path, waiting_for: str, logger: logging.Logger) -> Iterator[bool]:
    """Hold the lock on ``lock_path`` if the filesystem allows; yield whether this process had to wait for it.

    A waiting process says on ``logger`` (INFO) whom it waits for (the holder's host and pid, when the holder
    wrote them) at once and every :data:`WAIT_LOG_INTERVAL_S` seconds, and when it takes over. A filesystem that
    cannot lock costs duplicate work, never an error: callers must be correct without the lock.

    Args:
        lock_path: the lock file (created if missing, left in place).
        waiting_for: what the wait is for, for the log lines.
        logger: where the lines go.

    Examples:
        >>> import logging, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import exclusive
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     with exclusive(Path(tmp, ".x.lock"), "a test", logging.getLogger("test")) as waited:
        ...         print("held, waited:", waited)
        held, waited: False

    .. versionadded:: 0.2.0
    """
    lock = lock_factory(str(lock_path))
    held = waited = False
    try:
        if not lock.acquire(blocking=False):
            waited = True
            with _announcing(lock_path, waiting_for, logger):
                lock.acquire()
            logger.info("took over: %s is free", lock_path.name)
        held = True
    except (OSError, NotImplementedError) as exc:
        logger.warning("cannot lock %s (%s); going on without: duplicate work is possible", lock_path, exc)
    try:
        yield waited
    finally:
        if held:
            lock.release()


@contextlib.contextmanager
def _announcing(lock_path: Path, waiting_for: str, logger: logging.Logger) -> Iterator[None]:
    """Log whom this process waits for, now and every :data:`WAIT_LOG_INTERVAL_S` until the block ends."""
    done = threading.Event()
    start = time.monotonic()

    def say() -> None:
        first = True
        while True:
            who = holder(lock_path)
            by = f" (held by {who.replace(' ', ' pid ', 1)})" if who else ""
            if first:
                logger.info("waiting for %s%s", waiting_for, by)
            else:
                logger.info("still waiting (%.0f s) for %s%s", time.monotonic() - start, waiting_for, by)
            first = False
            if done.wait(WAIT_LOG_INTERVAL_S):
                return

    thread = threading.Thread(target=say, name="ignite_ext-lock-wait", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(1.0)
