"""The lock that saves duplicate work when several processes fetch or extract the same file: a POSIX record lock.

``fcntl`` is imported only when a lock is taken (where it is missing, Windows, the lock is :mod:`filelock`'s), so
importing this module works on every platform. Correctness never rests on the lock: callers stay correct without it.

A waiter waits in one blocking ``F_SETLKW`` (the kernel, or NFS's lock manager, wakes it: nothing polls). When the
holder is another user's process on this host, it gives up after a bound (:class:`LockWaitExpired`).

.. versionadded:: 0.2.0
.. versionchanged:: 0.3.0
   A stranger's lock is waited for at most ``patience_s``; another user's lock file is never written.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ignite_ext.errors import DownloadError

__all__ = [
    "PATIENCE_S",
    "WAIT_LOG_INTERVAL_S",
    "Lock",
    "LockWaitExpired",
    "RecordLock",
    "exclusive",
    "holder",
    "lock_factory",
]


class LockWaitExpired(DownloadError):
    """A process gave up waiting for a lock held by another user's process; the message names both.

    Examples:
        >>> from ignite_ext._locks import LockWaitExpired
        >>> from ignite_ext.data import DownloadError
        >>> issubclass(LockWaitExpired, DownloadError)
        True

    .. versionadded:: 0.3.0
    """


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

    While held, the file says who holds it (``host pid``), for the messages of those who wait, if it is this user's
    file: another user's lock file (in a shared folder) is locked, never written.

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
    .. versionchanged:: 0.3.0
       :meth:`wait`; another user's lock file is never written.
    """

    _threads: dict[str, threading.Lock] = {}
    #: Waits that a caller gave up on, still in their ``F_SETLKW``: the next caller of this process adopts them.
    _waiters: dict[str, _Waiter] = {}
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
            waiter = self._adopt()
            if waiter is not None:  # an earlier caller's wait is pending: no other descriptor while it is
                if blocking:
                    waiter.got.wait()
                elif not waiter.got.is_set() and waiter.give_up():
                    self._park(waiter)
                    self._thread_lock.release()
                    return False
                return self._took(waiter.fd, waiter.error)
            fd = _open(self.path)
        except BaseException:
            self._thread_lock.release()
            raise
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            self._thread_lock.release()
            if exc.errno in (errno.EAGAIN, errno.EACCES):  # held: POSIX lets a held lock answer either
                return False
            raise
        except BaseException:
            os.close(fd)
            self._thread_lock.release()
            raise
        return self._took(fd, None)

    def wait(self, patience_s: float | None, say: Callable[[str | None], None]) -> None:
        """Take the lock, waiting in one blocking ``F_SETLKW`` (in a daemon thread) until it is free.

        Gives up once a process of another user on this host has held it for ``patience_s`` seconds (None: never).
        A holder of this user's, or one this host cannot see (on another NFS client), is waited for as long as it
        holds the lock. ``say(holder)`` is called at once and every :data:`WAIT_LOG_INTERVAL_S` seconds.

        Raises:
            LockWaitExpired: gave up; nothing is held, and the pending ``F_SETLKW`` lets go of the lock as soon as
                it gets it (or the next caller of this process adopts it).
        """
        say_at = time.monotonic()
        if not self._thread_lock.acquire(blocking=False):  # behind another thread of this process: wait, as before
            say(f"{socket.gethostname()} pid {os.getpid()}")
            self._thread_lock.acquire()
            say_at += WAIT_LOG_INTERVAL_S
        try:
            import fcntl  # noqa: F401
        except ImportError:
            say(None)
            self._acquire_without_fcntl(True)
            return
        try:
            waiter = self._adopt() or _Waiter(self.path)
        except BaseException:
            self._thread_lock.release()
            raise
        try:
            look_at = time.monotonic()
            who, stranger_since, pid = None, None, None
            patience = float("inf") if patience_s is None else patience_s
            while not waiter.got.is_set():
                now = time.monotonic()
                # Who holds it: one F_OFD_GETLK (else F_GETLK) and /proc, on entry and once per slice of
                # patience_s after: O(1) requests to a lock server per waiter per slice, no loop of tries. Before
                # a line names a holder of this host, /proc (no server) says whether it still lives: a holder that
                # died passed the lock on, and the line names the next one.
                gone = now >= say_at and pid is not None and _gone(pid)
                if now >= look_at or gone:
                    who, stranger, pid = _identify(waiter.fd)
                    stranger_since = (stranger_since or now) if stranger else None
                    look_at = now + patience if now >= look_at else look_at
                    if stranger_since is not None and now - stranger_since >= patience and waiter.give_up():
                        self._park(waiter)
                        raise LockWaitExpired(
                            f"{self.path} is held by {who}, a process of another user, for {patience_s:g} s"
                        )
                if now >= say_at:
                    say(who)
                    say_at = now + WAIT_LOG_INTERVAL_S
                waiter.got.wait(max(0.0, min(look_at, say_at) - now))
        except LockWaitExpired:
            self._thread_lock.release()
            raise
        except BaseException:
            if waiter.give_up():
                self._park(waiter)
                self._thread_lock.release()
                raise
            self._took(waiter.fd, waiter.error)
            self.release()
            raise
        self._took(waiter.fd, waiter.error)

    def _adopt(self) -> _Waiter | None:
        waiter = RecordLock._waiters.pop(self._key, None)
        return waiter if waiter is not None and waiter.adopt() else None

    def _park(self, waiter: _Waiter) -> None:
        RecordLock._waiters[self._key] = waiter

    def _took(self, fd: int, error: BaseException | None) -> bool:
        """Note the lock as held on ``fd`` (or raise ``error``: then ``fd`` is closed)."""
        if error is not None:
            self._thread_lock.release()
            raise error
        self._fd = fd
        RecordLock.held.add(self._key)
        with contextlib.suppress(OSError):  # who holds it, for the waiters' messages (best effort), in its own file
            if os.fstat(fd).st_uid == os.geteuid():
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
                    if os.fstat(self._fd).st_uid == os.geteuid():
                        os.ftruncate(self._fd, 0)
                    fcntl.lockf(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = -1
            elif self._filelock is not None:
                self._filelock.release()
                self._filelock = None
        finally:
            self._thread_lock.release()


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)


class _Waiter:
    """One blocking ``F_SETLKW`` on a descriptor of its own, in a daemon thread; never keeps a lock nobody waits for."""

    def __init__(self, path: str) -> None:
        self.fd = _open(path)
        self.got = threading.Event()  # set when the F_SETLKW returned (error: it failed, fd is closed)
        self.error: OSError | None = None
        self._mutex = threading.Lock()
        self._abandoned = self._done = False
        threading.Thread(target=self._run, name="ignite_ext-lock-wait", daemon=True).start()

    def _run(self) -> None:
        import fcntl

        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        except OSError as exc:
            self.error = exc
        with self._mutex:
            self._done = True
            if self._abandoned or self.error is not None:  # nobody takes it: let go at once
                with contextlib.suppress(OSError):
                    fcntl.lockf(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
        self.got.set()

    def give_up(self) -> bool:
        """Abandon the wait; False if the lock came first (then the caller holds it)."""
        with self._mutex:
            self._abandoned = not self._done
            return self._abandoned

    def adopt(self) -> bool:
        """Take over an abandoned wait; False if it is over (its lock already let go of)."""
        with self._mutex:
            self._abandoned = self._done
            return not self._done


# struct flock of 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid, padded to its 8-byte alignment.
_FLOCK = "hhqqi0q"


def _blocker(fd: int) -> int | None:
    """The pid of the process whose lock keeps ``fd``'s file from being locked; None if unknown (another host)."""
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        return None
    import fcntl

    # F_OFD_GETLK (Linux 3.15+) sees even this process's other locks; F_GETLK where the kernel refuses it.
    for command in [getattr(fcntl, name) for name in ("F_OFD_GETLK", "F_GETLK") if hasattr(fcntl, name)]:
        try:
            answer = fcntl.fcntl(fd, command, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        except OSError:
            continue
        kind, _, _, _, pid = struct.unpack(_FLOCK, answer)
        return pid if kind != fcntl.F_UNLCK and pid > 0 else None
    return None


def _gone(pid: int) -> bool:
    """Whether the process ``pid`` of this host has exited (a zombie has: its locks are let go of at exit)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _identify(fd: int) -> tuple[str | None, bool, int | None]:
    """Who holds the lock on ``fd``'s file: as the waiters' lines name it, whether another user's, its pid here.

    The pid is None where the holder is not a process of this host (another NFS client) or unknown.
    """
    written = ""
    with contextlib.suppress(OSError):
        written = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    pid = _blocker(fd)
    if pid is None:
        return (written.replace(" ", " pid ", 1) if written else None), False, None
    if written == f"{socket.gethostname()} {pid}":
        return written.replace(" ", " pid ", 1), False, pid  # a holder of this package writes its own user's file only
    uid, command = None, "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            command = f.read().split(b"(", 1)[1].rsplit(b")", 1)[0].decode("utf-8", "replace")
        with open(f"/proc/{pid}/status", "rb") as f:
            uid = int(next(row for row in f if row.startswith(b"Uid:")).split()[2])  # the effective uid
    if uid is None:  # hidden from this user (hidepid) or just gone; /proc missing altogether says nothing
        return f"pid {pid} on this host", os.path.isdir("/proc/self"), pid
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        user = str(uid)
    return f"pid {pid} on this host (user {user}, {command})", uid != os.geteuid(), pid


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
#: How long :func:`exclusive` waits by default for a lock that another user's process holds: twice (30 s + 30 s),
#: ``download_url``'s default ``timeout`` and ``low_speed_time``.
PATIENCE_S = 120.0


@contextlib.contextmanager
def exclusive(
    lock_path: Path, waiting_for: str, logger: logging.Logger, patience_s: float | None = PATIENCE_S
) -> Iterator[bool]:
    """Hold the lock on ``lock_path`` if the filesystem allows; yield whether this process had to wait for it.

    A waiting process says on ``logger`` (INFO) whom it waits for (the holder's host and pid, when the holder
    wrote them, else its pid, user and command) at once and every :data:`WAIT_LOG_INTERVAL_S` seconds; what it
    finds once the lock is free is the caller's to say (``waited`` tells it that it waited). It waits as long as
    a process of its own user holds the lock, or one this host cannot see (on another NFS client), but gives up
    after ``patience_s`` on another user's process (:meth:`RecordLock.wait`). A filesystem that cannot lock costs
    duplicate work, never an error: callers must be correct without the lock.

    Args:
        lock_path: the lock file (created if missing, left in place).
        waiting_for: what the wait is for, for the log lines.
        logger: where the lines go.
        patience_s: how long to wait for another user's process on this host; None: as long as it holds the lock.

    Raises:
        LockWaitExpired: another user's process held the lock for ``patience_s``; the message names it.

    Examples:
        >>> import logging, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._locks import exclusive
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     with exclusive(Path(tmp, ".x.lock"), "a test", logging.getLogger("test")) as waited:
        ...         print("held, waited:", waited)
        held, waited: False

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.3.0
       ``patience_s``.
    .. versionchanged:: 0.4.0
       No line when the lock comes free ("took over" was untrue when the holder had done the work).
    """
    lock = lock_factory(str(lock_path))
    held = waited = False
    started = time.monotonic()
    said: list[str] = []

    def say(who: str | None) -> None:
        by = f" (held by {who})" if who else ""
        if said:
            logger.info("still waiting (%.0f s) for %s%s", time.monotonic() - started, waiting_for, by)
        else:
            logger.info("waiting for %s%s", waiting_for, by)
        said.append(by)

    try:
        if not lock.acquire(blocking=False):
            waited = True
            if isinstance(lock, RecordLock):
                lock.wait(patience_s, say)
            else:  # a lock of another kind (tests replace the factory)
                say(None)
                lock.acquire()
        held = True
    except LockWaitExpired as exc:
        elapsed = time.monotonic() - started
        raise LockWaitExpired(
            f"gave up after {elapsed:.0f} s waiting for {waiting_for}: {exc}; end that process (or ask its owner "
            "to), or use another directory"
        ) from None
    except (OSError, NotImplementedError) as exc:
        logger.warning("cannot lock %s (%s); going on without: duplicate work is possible", lock_path, exc)
    try:
        yield waited
    finally:
        if held:
            lock.release()
