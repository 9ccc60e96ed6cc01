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
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable

from ignite_ext.distributed.liveness import keeper
from ignite_ext.distributed.store.clients import Store, endpoint, innermost, put_once, read
from ignite_ext.distributed.store.keys import CUTS_KEY, PREFIX_KEY, cut_key, probe_key, proof_key
from ignite_ext.distributed.store.wire import WireStore, connect_proven, flavour_for

__all__ = ["NOT_YET", "Address", "CutListener", "KeeperHandle", "proven_wire", "wire_address"]

_log = logging.getLogger(__name__)

#: A store as the wire sees it: host, port, the prefix before each key, and the protocol flavour proven there.
Address = tuple[str, int, str, str]


def wire_address(store: Store, rank: int = 0) -> tuple[Address | None, str]:
    """How a :class:`~ignite_ext.distributed.store.wire.WireStore` reaches ``store``, proven; or None and why not.

    None when ``store`` is not served by a TCPStore, when its key prefix is not known yet (torch's own prefixed
    store: rank 0 finds it with one ``list_keys`` and publishes it, the others read it: call again later), or when
    its torch's protocol flavour did not prove every opcode used
    (:func:`~ignite_ext.distributed.store.wire.connect_proven`, about 12 requests, once per process).

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import namespaced
        >>> from ignite_ext.distributed.liveness.watch import wire_address
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> (host, port, prefix, flavour), _ = wire_address(namespaced(dist.PrefixStore("job", server)))
        >>> (host, port) == ("127.0.0.1", server.port), prefix == "job/" or prefix.startswith("ignite_ext-")
        (True, True)
        >>> wire_address(dist.HashStore())
        (None, 'not a TCPStore the package reaches on its own')

    .. versionadded:: 0.3.0
    """
    address, wire, why = proven_wire(store, rank)
    if wire is not None:
        wire.close()
    return address, why


#: What :func:`proven_wire` says while rank 0 has not published the prefix yet (ask again later).
NOT_YET = "rank 0 has not published the store's key prefix yet"


def _discover(store: Store, raw: Store) -> str | None:
    """The prefix ``store`` puts before keys, found by writing a probe key through it and listing the server's keys.

    One ``list_keys`` (``O(N)`` keys at the group's start), by rank 0 only: the others read what it publishes.
    """
    probe = probe_key(uuid.uuid4().hex)
    store.set(probe, "1")
    try:
        keys = [k for k in raw.list_keys() if k.endswith(probe)]
    except (AttributeError, RuntimeError):
        return None  # a server without list_keys
    finally:
        store.delete_key(probe)
    return keys[0][: -len(probe)] if len(keys) == 1 else None


def _published_prefix(store: Store, raw: Store, rank: int) -> str | None:
    """The prefix rank 0 published; rank 0 finds and publishes it (None: not published yet, or not found)."""
    published = read(store, PREFIX_KEY)
    if published is not None:
        return published.decode()[2:]
    if rank != 0:
        return None
    prefix = _discover(store, raw)
    if prefix is not None:
        put_once(store, PREFIX_KEY, b"p:" + prefix.encode())
    return prefix


def _place(store: Store, rank: int) -> tuple[str, int, str] | str:
    """The store's host, port and wire prefix, or why there is none (yet)."""
    place = endpoint(store)
    if place is not None:  # the package's own namespace (torch without Store.clone), or a bare TCPStore
        return place.host, place.port, place.wire_prefix
    raw = innermost(store)
    host, port = getattr(raw, "host", None), getattr(raw, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return "not a TCPStore the package reaches on its own"
    # torch's own store, which it clones itself: its prefix, as rank 0 lists it (stragglers start a moment later).
    prefix = _published_prefix(store, raw, rank)
    return NOT_YET if prefix is None else (host, port, prefix)


def proven_wire(store: Store, rank: int = 0) -> tuple[Address | None, WireStore | None, str]:
    """As :func:`wire_address`, and the proven connection itself (the cut listener keeps it), or None and why."""
    place = _place(store, rank)
    if isinstance(place, str):
        return None, None, place
    host, port, prefix = place
    probe = proof_key(f"{os.getpid()}-{secrets.token_hex(4)}")
    flavour = flavour_for(torch_version())
    wire, why = connect_proven(host, port, prefix, store, probe, flavour)
    if wire is None:
        return None, None, f"torch {torch_version()}'s store protocol is not one this package speaks ({why})"
    return (host, port, prefix, wire.flavour), wire, ""


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
        >>> import datetime, os, time
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.liveness.keeper import process_identity
        >>> from ignite_ext.distributed.liveness.watch import KeeperHandle, wire_address
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> address, _ = wire_address(server)
        >>> handle = KeeperHandle(address, rank=0, world_size=2, every=0.5, identity=process_identity(os.getpid()))
        >>> while not handle.ready(): time.sleep(0.01)
        >>> handle.beat(); handle.stop()
        0

    .. versionadded:: 0.3.0
    """

    def __init__(self, address: Address, rank: int, world_size: int, every: float, identity: str) -> None:
        host, port, prefix, flavour = address
        beats, self._out = os.pipe()
        os.set_blocking(self._out, False)  # a keeper that does not read must never block a beat
        pid = str(os.getpid())
        args = [host, str(port), prefix, str(rank), str(world_size), pid, str(beats), str(every), flavour, identity]
        # The keeper inherits this thread's signal mask: blocked until it ignores them, a SIGTERM sent to the whole
        # job while it starts (an interpreter's second or more under load) stays pending instead of ending it.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, keeper.IGNORED)
        try:
            # -I -S: the standard library only, nothing of the rank's environment (and no torch to import)
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", keeper.__file__, *args],
                pass_fds=(beats,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(beats)
        assert self._process.stdout is not None
        self._said = self._process.stdout
        os.set_blocking(self._said.fileno(), False)
        self._ready = False
        self._owner = os.getpid()  # a forked child (a DataLoader worker) holds a copy of the pipe: never its goodbye

    def ready(self) -> bool:
        """Whether the keeper watches the rank now, or never will (it ended); reads its pipe, never waits.

        Starting an interpreter takes 20 ms on an idle host and a second or more on a loaded one: until the keeper
        says so, a GIL hold of the rank is not beaten for.
        """
        if not self._ready:
            try:
                said = os.read(self._said.fileno(), 64)
                self._ready = said == b"" or keeper.READY in said  # b"": it closed its output (or ended)
            except BlockingIOError:  # nothing said yet
                self._ready = self._process.poll() is not None
            if self._ready:
                self._said.close()
        return self._ready

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
        self._said.close()
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
        proof: the value of :data:`~ignite_ext.distributed.store.keys.CUTS_KEY` as torch's client read it.
        first: the number of the first cut to wait for.
        on_cut: called (in the listener's thread) with each cut's number, in order, as its key is written.

    Examples:
        >>> import datetime, threading
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.liveness.watch import CutListener, wire_address
        >>> from ignite_ext.distributed.store.codecs import encode_cut
        >>> from ignite_ext.distributed.store.keys import CUTS_KEY, cut_key
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> heard = threading.Event()
        >>> server.set(CUTS_KEY, "0")
        >>> address, _ = wire_address(server)
        >>> listener = CutListener(address, b"0", 1, lambda index: heard.set())
        >>> server.set(cut_key(1), encode_cut(0, 3.0, [2])); heard.wait(5)
        True
        >>> listener.close()

    .. versionadded:: 0.3.0
    """

    def __init__(
        self, address: Address, proof: bytes, first: int, on_cut: Callable[[int], None], wire: WireStore | None = None
    ) -> None:
        host, port, prefix, flavour = address
        # A proven connection is taken over (no second connection to the store for the listener).
        self._wire = wire if wire is not None else WireStore(host, port, prefix, timeout=10.0, flavour=flavour)
        self._wire.settimeout(10.0)
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
