"""The rank's side of process watching: its keeper process, and a thread that hears of each cut at once.

:mod:`~ignite_ext.distributed.liveness.keeper` says what a keeper does. Here the heartbeat finds how to reach its
store without torch (:func:`wire_address`), proves it (the listener's client must read what torch's wrote), starts
the keeper (:class:`KeeperHandle`; the rank publishes its process's identity for it, and it connects to the store
only when it must beat or report) and a :class:`CutListener`: a thread blocked on the key of the group's next cut,
so that a cut wakes this process's waiters when it is posted, not at the next beat. Both cost nothing while nothing
fails: the keeper makes no request while its rank beats, the listener one request per cut.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable

from ignite_ext.distributed._store import CUTS_KEY, Store, cut_key, endpoint
from ignite_ext.distributed.liveness import keeper
from ignite_ext.distributed.store.wire import WireStore, prove

__all__ = ["Address", "CutListener", "KeeperHandle", "wire_address"]

_log = logging.getLogger(__name__)

#: A store as the wire sees it: host, port, the prefix before each key, and the protocol flavour proven there.
Address = tuple[str, int, str, str]


def wire_address(store: Store) -> tuple[Address | None, str]:
    """How a :class:`~ignite_ext.distributed.store.wire.WireStore` reaches ``store``, proven; or None and why not.

    None when ``store`` is not one whose server and prefix the package knows (a :func:`~ignite_ext.distributed.\
_store.namespaced` store or a bare TCPStore: see :func:`~ignite_ext.distributed._store.endpoint`), or when no
    flavour of torch's protocol proved every opcode used (:func:`~ignite_ext.distributed.store.wire.prove`, about
    12 requests, once per process).

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed._store import namespaced
        >>> from ignite_ext.distributed.liveness.watch import wire_address
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> (host, port, prefix, flavour), _ = wire_address(namespaced(dist.PrefixStore("job", server)))
        >>> (host, port) == ("127.0.0.1", server.port), prefix.startswith("ignite_ext-"), prefix.endswith("/")
        (True, True, True)
        >>> wire_address(dist.HashStore())
        (None, 'not a TCPStore the package reaches on its own')

    .. versionadded:: 0.3.0
    """
    place = endpoint(store)
    if place is None:
        return None, "not a TCPStore the package reaches on its own"
    probe = f"ignite_ext/proof/{os.getpid()}-{secrets.token_hex(4)}"
    flavour, why = prove(place.host, place.port, place.wire_prefix, store, probe)
    if flavour is None:
        return None, f"torch {torch_version()}'s store protocol is not one this package speaks ({why})"
    return (place.host, place.port, place.wire_prefix, flavour), ""


def torch_version() -> str:
    """The version of the torch this process runs (for messages)."""
    import torch

    return str(torch.__version__)


class KeeperHandle:
    """This rank's keeper process: started here, told of each beat, said goodbye to at a normal end.

    Args:
        address: the store, as :func:`wire_address` found it.
        rank: this rank.
        world_size: the group's size.
        every: the beat interval in seconds.

    Examples:
        >>> import datetime, os
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.liveness.watch import KeeperHandle, wire_address
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> address, _ = wire_address(server)
        >>> handle = KeeperHandle(address, rank=0, world_size=2, every=0.5)
        >>> handle.beat(); handle.stop()
        0

    .. versionadded:: 0.3.0
    """

    def __init__(self, address: Address, rank: int, world_size: int, every: float) -> None:
        host, port, prefix, flavour = address
        beats, self._out = os.pipe()
        os.set_blocking(self._out, False)  # a keeper that does not read must never block a beat
        args = [host, str(port), prefix, str(rank), str(world_size), str(os.getpid()), str(beats), str(every), flavour]
        try:
            # -I -S: the standard library only, nothing of the rank's environment (and no torch to import)
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", keeper.__file__, *args], pass_fds=(beats,), stdin=subprocess.DEVNULL
            )
        finally:
            os.close(beats)
        self._owner = os.getpid()  # a forked child (a DataLoader worker) holds a copy of the pipe: never its goodbye

    def beat(self) -> None:
        """Tell the keeper the rank's heartbeat thread runs."""
        with contextlib.suppress(OSError):  # a full pipe (the keeper reads later) or a keeper gone: nothing to tell
            os.write(self._out, b".")

    def stop(self) -> int | None:
        """Say goodbye (a normal end, not a death), and return the keeper's exit status (None: not ended yet)."""
        if os.getpid() != self._owner or self._out < 0:
            return None
        with contextlib.suppress(OSError):
            os.write(self._out, b"q")
        os.close(self._out)
        self._out = -1
        try:
            return self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    @property
    def pid(self) -> int:
        """The keeper's process id."""
        return self._process.pid


class CutListener:
    """A daemon thread blocked on the group's next cut key: ``on_cut`` is called as each cut is posted.

    Its connection is also the proof that the wire client reaches the group's keys: before it listens, it must read
    ``proof`` (what torch's client read of the cut counter) there, or it raises ``ValueError`` (another torch's
    protocol, another prefix) and the rank does without process watching. One connection per process for good:
    a TCPStore server resolves the name of each client that connects, in its only thread.

    Args:
        address: the store, as :func:`wire_address` found it.
        proof: the value of ``ignite_ext/cuts`` as torch's client read it.
        first: the number of the first cut to wait for.
        on_cut: called (in the listener's thread) with each cut's number, in order, as its key is written.

    Examples:
        >>> import datetime, threading
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.liveness.watch import CutListener, wire_address
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> heard = threading.Event()
        >>> server.set("ignite_ext/cuts", "0")
        >>> address, _ = wire_address(server)
        >>> listener = CutListener(address, b"0", 1, lambda index: heard.set())
        >>> server.set("ignite_ext/cut/1", "0|3.000|2"); heard.wait(5)
        True
        >>> listener.close()

    .. versionadded:: 0.3.0
    """

    def __init__(self, address: Address, proof: bytes, first: int, on_cut: Callable[[int], None]) -> None:
        host, port, prefix, flavour = address
        self._wire = WireStore(host, port, prefix, timeout=10.0, flavour=flavour)
        if self._wire.read(CUTS_KEY) != proof:
            self._wire.close()
            raise ValueError("the wire client does not read what torch's client wrote: no process watching")
        self._wire.settimeout(None)  # it blocks until the next cut, however long
        self._on_cut = on_cut
        self._owner = os.getpid()  # a forked child holds the same socket: its exit must not shut it down
        self._thread = threading.Thread(target=self._run, args=(first,), name="ignite_ext-cuts", daemon=True)
        self._thread.start()

    def _run(self, index: int) -> None:
        try:
            while True:
                self._wire.wait([cut_key(index)])
                self._on_cut(index)
                index += 1
        except (OSError, ValueError):  # closed at exit, or the store is gone
            return

    def close(self) -> None:
        """End the thread (its blocked wait returns at once); in a forked child, only let go of the copy."""
        if os.getpid() != self._owner:
            self._wire.detach()
            return
        self._wire.close()
        self._thread.join(timeout=1.0)
