"""A watchdog for the store channel's steps: a request to a silent store host must not block for 15 minutes.

A TCPStore request to a paused or cut-off host blocks its thread until TCP gives up (about 15 minutes); the
client's own timeout only bounds waits for keys. The steps run in the calling thread (handing them to another
thread costs a context switch each, a millisecond a block on a busy machine), each armed with the time by which
its store must have answered. One daemon thread per process sleeps until the earliest of those times; a step
still armed then is overdue, and the watchdog shuts down every connection of this process to that store
(found in ``/proc/self/net/tcp*`` and ``/proc/self/fd``). The blocked request then fails at once
("Connection was likely closed"), and the step, and every other step armed on that store, raises
:class:`~ignite_ext.errors.StoreLostError`: a store that silent is lost for every thread of the process anyway.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from typing import Any

from ignite_ext.distributed.store.clients import innermost
from ignite_ext.settings import STORE_WATCHDOG

__all__ = ["Watchdog", "store_port", "watchdog", "watchdog_enabled"]

# How late the watchdog thread may wake before it takes the delay for a stop of the process, not of the store.
_LATE_S = 0.5


def store_port(store: Any) -> int | None:
    """The TCP port of the server behind ``store`` (through prefix stores), or None if it is not a TCPStore.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.watchdog import store_port
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> store_port(dist.PrefixStore("p", server)) == server.port, store_port(dist.HashStore())
        (True, None)

    .. versionadded:: 0.2.0
    """
    store = innermost(store)
    port = getattr(store, "port", None)
    return port if isinstance(port, int) and hasattr(store, "host") else None


def _sockets_to(port: int) -> list[int]:
    """The file descriptors of this process's TCP connections whose remote end is ``port``."""
    inodes: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]  # noqa: SIM115 (read whole at once)
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and int(fields[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            fds.append(int(fd))
    return fds


class Watchdog:
    """Times the armed steps of this process; shuts down the connections to the store of one that is overdue.

    Examples:
        >>> import time
        >>> from ignite_ext.distributed.store.watchdog import Watchdog
        >>> dog = Watchdog()
        >>> token = dog.arm(time.monotonic() + 60, port=1)  # a step that must hear from port 1 within 60 s
        >>> dog.extend(token, time.monotonic() + 120)  # it waits longer, on purpose
        >>> dog.disarm(token)  # done in time
        False

    .. versionadded:: 0.2.0
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, int]] = {}  # token -> (deadline, port)
        self._tripped: set[int] = set()
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._sleeps_until = 0.0  # when the thread wakes next, unless notified

    def arm(self, deadline: float, port: int) -> int:
        """Watch a step that must hear from the store at ``port`` by ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            token = next(self._tokens)
            self._armed[token] = (deadline, port)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ignite_ext-store-watchdog", daemon=True)
                self._thread.start()
            elif deadline < self._sleeps_until:
                self._cond.notify()  # the thread sleeps past this deadline (it had nothing earlier to watch)
        return token

    def extend(self, token: int, deadline: float) -> None:
        """Move the step's deadline (a later one: the thread finds it when it wakes; no wake-up needed)."""
        with self._cond:
            if token in self._armed:
                self._armed[token] = (deadline, self._armed[token][1])

    def disarm(self, token: int) -> bool:
        """Stop watching the step; True when it was overdue and its store's connections were shut down."""
        with self._cond:
            self._armed.pop(token, None)
            if token in self._tripped:
                self._tripped.discard(token)
                return True
            return False

    def _forgive(self, late: float) -> None:
        """Move every deadline on by ``late`` seconds when this thread woke that late (called with the lock held).

        A thread that wakes seconds after its time was not running: the process was stopped (SIGSTOP, a debugger)
        or starved of CPU. Its stores had no chance to answer meanwhile, so that time does not count against them;
        a rank stopped for long has been declared dead by the others, and learns that from its next beat instead of
        taking the store for lost.
        """
        if late > _LATE_S:
            for token, (deadline, port) in self._armed.items():
                self._armed[token] = (deadline + late, port)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                ports = {port for deadline, port in self._armed.values() if deadline <= now}
                # Every step on a cut port is tripped: its connection is shut down with the overdue one's.
                overdue = [(t, port) for t, (_, port) in self._armed.items() if port in ports]
                for token, _ in overdue:
                    self._tripped.add(token)
                    del self._armed[token]
                if not overdue:
                    self._sleeps_until = min((d for d, _ in self._armed.values()), default=now + 3600.0)
                    self._cond.wait(max(0.01, self._sleeps_until - now))
                    self._forgive(time.monotonic() - max(now, self._sleeps_until))
                    continue
            for port in {port for _, port in overdue}:
                for fd in _sockets_to(port):
                    try:
                        sock = socket.socket(fileno=fd)
                    except OSError:
                        continue
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # the blocked request returns at once; the fd stays its owner's
                    except OSError:
                        pass
                    finally:
                        sock.detach()


_WATCHDOG = Watchdog()


def _after_fork() -> None:
    global _WATCHDOG
    _WATCHDOG = Watchdog()  # the thread did not come along, and its lock may have been held at the fork


os.register_at_fork(after_in_child=_after_fork)


def watchdog() -> Watchdog:
    """This process's watchdog.

    .. versionadded:: 0.2.0
    """
    return _WATCHDOG


def watchdog_enabled() -> bool:
    """False when ``IGNITE_EXT_STORE_WATCHDOG=0``: a silent store then blocks its requests until TCP gives up.

    The docs' settings page (:doc:`/settings`) lists it with the package's other variables.

    .. versionadded:: 0.2.0
    """
    return STORE_WATCHDOG.read()
