"""The lock that saves duplicate work when several processes fetch or extract the same file: a POSIX record lock.

``fcntl`` is imported only when a lock is taken (where it is missing, Windows, the lock is :mod:`filelock`'s), so
importing this module works on every platform. Correctness never rests on the lock: callers stay correct without it.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

__all__ = ["WAIT_LOG_INTERVAL_S", "Lock", "RecordLock", "exclusive", "holder", "lock_factory"]


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
        >>> from ignite_ext._locks import RecordLock
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
        >>> from ignite_ext._locks import holder
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
        >>> from ignite_ext._locks import exclusive
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
