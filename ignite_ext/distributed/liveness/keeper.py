"""A rank's keeper: a small process beside each rank, outside its interpreter, that tells a GIL hold from a death.

A rank's heartbeat is a Python thread: a main thread that holds the GIL in a long C call stops it as surely as a
death does, and a rank's death is seen by the others only ``T`` later, by its silence. The keeper sees what the
other ranks cannot, because it runs on the rank's host and needs no GIL of the rank's:

* **The rank's process ends** (SIGKILL, a segfault, the OOM killer; not a normal exit, which says goodbye): the
  keeper's ``pidfd`` of it becomes readable at once; the keeper waits :data:`SETTLE` seconds for the other ranks
  of the host that die with it, and posts one cut with every rank of its host whose process is gone. The other
  ranks learn of it at once (each process has a thread blocked on the next cut's key): a death on a live host
  is reported in well under a second, not ``T``. A rank that dies while its keeper starts (an interpreter takes
  a second or more to start on a loaded host) is reported the same way: the keeper is given the identity the
  rank published, and a process that no longer has it died, unless its goodbye waits in the pipe. The rank's
  blocks wait for the keeper's word that it watches (:data:`READY`), at most ``T`` once per process.
* **The rank's process lives but does not beat** (its heartbeat thread was not scheduled for two beats: a GIL
  hold, a swapping host) while its state is running or sleeping, not stopped: the keeper beats for it, one
  ``add`` a beat. A process that is stopped (SIGSTOP, a frozen container) is not beaten for, so it is declared
  dead as before, and so is one whose host is lost or cut off (its keeper with it).

The keeper imports nothing but the standard library (about 10 MB and 20 ms to start, not torch's seconds): it
talks to the group's TCPStore with :class:`~ignite_ext.distributed.store.wire.WireStore` (loaded by its path), a
client of torch's private protocol. The rank proves every opcode the keeper uses against torch's own client
before it starts one (:func:`~ignite_ext.distributed.store.wire.prove`), and passes it the flavour it proved;
without that proof (another torch, another store) no keeper runs, the rank logs why, and detection is the
heartbeat's alone.

The keeper's costs: no store request while its rank beats; one ``add`` per beat while its rank is silent; on a
death, about ``4 + 2 L + c`` requests (``L`` ranks on the host, ``c`` cuts so far).

The keeper ignores ``SIGINT``, ``SIGTERM`` and ``SIGHUP``: a launcher signals every process of a job (Slurm's
``scancel`` and preemption), and a rank that handles ``SIGTERM`` to save a checkpoint stays watched until it ends.

.. versionadded:: 0.3.0
.. versionchanged:: 0.6.0
   The keeper outlives a ``SIGTERM`` or ``SIGHUP`` its rank survives; :data:`SETTLE` is 0.02 s (was 0.1 s).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

__all__ = ["IGNORED", "READY", "SETTLE", "main", "process_identity", "running"]

#: Seconds a keeper waits after its rank's death for the host's other ranks that die with it (one cut for all).
#: Short: ``srun --kill-on-bad-exit=1`` SIGTERMs the survivors 100-150 ms after a death, and their report of it must
#: come first (with 0.1 s it came first in about 2 runs of 6).
SETTLE = 0.02

#: What a keeper writes on its standard output once it watches its rank.
READY = b"ready\n"

#: The signals a keeper ignores. Its rank starts it with them blocked, so none ends it before it ignores them.
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

if TYPE_CHECKING or __package__:
    from ignite_ext._fs import process_identity
    from ignite_ext.distributed.store.codecs import cut_ranks, encode_cut
    from ignite_ext.distributed.store.keys import CUTS_KEY, cut_key, heartbeat_key, proc_key
    from ignite_ext.distributed.store.wire import WireStore
else:  # run by its path with -I -S, without the package on sys.path: the store room's modules by their paths
    import importlib.util

    def _by_path(name: str):  # type: ignore[no-untyped-def]  # (never type-checked: see the branch above)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location(f"_ignite_ext_{name}", os.path.join(here, "store", name + ".py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    _keys, _codecs = _by_path("keys"), _by_path("codecs")
    WireStore = _by_path("wire").WireStore
    CUTS_KEY, cut_key, heartbeat_key, proc_key = _keys.CUTS_KEY, _keys.cut_key, _keys.heartbeat_key, _keys.proc_key
    cut_ranks, encode_cut = _codecs.cut_ranks, _codecs.encode_cut
    _fs_spec = importlib.util.spec_from_file_location(
        "_ignite_ext_fs",
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "_fs.py"),
    )
    _fs = importlib.util.module_from_spec(_fs_spec)
    _fs_spec.loader.exec_module(_fs)
    process_identity = _fs.process_identity


def running(pid: int) -> bool:
    """Whether process ``pid`` is running or sleeping: not stopped, traced, a zombie or gone.

    Examples:
        >>> import os
        >>> from ignite_ext.distributed.liveness.keeper import running
        >>> running(os.getpid())
        True

    .. versionadded:: 0.3.0
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] in (b"R", b"S", b"D")


def _same_host(mine: str, theirs: bytes | None) -> bool:
    return theirs is not None and theirs.decode().split("|")[:2] == mine.split("|")[:2]


def _gone(identity: bytes) -> bool:
    return process_identity(int(identity.decode().split("|")[2])) != identity.decode()


def _dead_on_this_host(wire: WireStore, rank: int, world_size: int, mine: str) -> list[int]:
    """Ranks whose process is gone among the rank's host neighbours, scanned outwards in rank order.

    Launchers give a host's ranks consecutive numbers, so the scan stops at the first rank of another host (or
    without a keeper) in each direction: ``2 L`` reads for ``L`` ranks on the host, whatever the world size.
    """
    dead = [rank]
    for step in (-1, 1):
        peer = rank + step
        while 0 <= peer < world_size:
            theirs = wire.read(proc_key(peer))
            if not _same_host(mine, theirs):
                break
            if theirs is not None and _gone(theirs):
                dead.append(peer)
            peer += step
    return sorted(dead)


def _post_cut(wire: WireStore, ranks: list[int], author: int) -> None:
    """Post ``ranks`` as the group's next cut(s), as the heartbeat does (see its module docstring)."""
    remaining = set(ranks)
    while remaining:
        posted = int(wire.read(CUTS_KEY) or b"0")
        for index in range(1, posted + 1):
            payload = wire.read(cut_key(index))
            if payload is not None:
                remaining -= cut_ranks(payload)
        if not remaining:
            return
        index = posted + 1
        mine = encode_cut(author, 0.0, sorted(remaining))
        won = wire.compare_set(cut_key(index), b"", mine) == mine
        wire.compare_set(CUTS_KEY, str(index - 1).encode(), str(index).encode())
        if won:
            return


class _Lazy:
    """A :class:`WireStore` connected at its first use: a keeper whose rank beats never connects at all.

    A TCPStore server resolves the name of each client that connects, in its only thread: a connection per rank
    made at the group's start, for a keeper that may never need it, is a stall of the store waiting to happen.
    """

    def __init__(self, host: str, port: int, prefix: str, timeout: float, flavour: str) -> None:
        self._args = (host, port, prefix, timeout, flavour)
        self._wire: WireStore | None = None

    def __call__(self) -> WireStore:
        if self._wire is None:
            self._wire = WireStore(*self._args)
        return self._wire


def _goodbye_waiting(beats: int) -> bool:
    """Whether the rank's goodbye is in the pipe already (it ended normally before its keeper started)."""
    os.set_blocking(beats, False)
    try:
        return b"q" in os.read(beats, 1 << 16)
    except BlockingIOError:
        return False
    finally:
        os.set_blocking(beats, True)


def _keep(wire: _Lazy, rank: int, world_size: int, parent: int, beats: int, every: float, mine: str | None) -> str:
    """The keeper's loop for ``rank`` (process ``parent``): returns why it ended.

    Args:
        wire: a client of the group's store, connected when first needed.
        rank: the kept rank.
        world_size: the group's size.
        parent: the rank's process id.
        beats: the read end of the pipe on which the rank's heartbeat thread writes ``.`` per beat, ``q`` to end.
        every: the beat interval in seconds.
        mine: the rank's process identity as the rank published it (None: read it here, as keepers before 0.4).
    """
    mine = mine or process_identity(parent)
    try:
        pidfd = os.pidfd_open(parent)
    except OSError:
        pidfd = -1
    if mine is None:
        return "the rank's process is gone already"
    if pidfd < 0 or process_identity(parent) != mine:
        # The rank died while this keeper started (a loaded host takes a second or more to start an interpreter):
        # a death all the same, unless the rank said goodbye first.
        if _goodbye_waiting(beats):
            return "goodbye"
        time.sleep(SETTLE)
        _post_cut(wire(), _dead_on_this_host(wire(), rank, world_size, mine), author=rank)
        return "its process ended"
    _say_ready()
    watched = [pidfd, beats]
    last = time.monotonic()
    while True:
        readable, _, _ = select.select(watched, [], [], every)
        if beats in readable:
            data = os.read(beats, 4096)
            if b"q" in data:
                return "goodbye"
            if not data:  # every holder of the write end closed it, without a goodbye: the pidfd tells the rest
                watched.remove(beats)
            last = time.monotonic()
        if pidfd in readable:
            time.sleep(SETTLE)
            _post_cut(wire(), _dead_on_this_host(wire(), rank, world_size, mine), author=rank)
            return "its process ended"
        if time.monotonic() - last >= 2 * every and running(parent):
            wire().add(heartbeat_key(rank), 1)
            last = time.monotonic()


def _say_ready() -> None:
    """Tell the rank this keeper watches it (one line on stdout, which the rank reads from a pipe), then close it."""
    with contextlib.suppress(OSError):
        os.write(1, READY)
        os.close(1)


def main(argv: Sequence[str] | None = None) -> int:
    """The keeper process: ``keeper.py HOST PORT PREFIX RANK WORLD_SIZE PARENT_PID BEATS_FD EVERY [FLAVOUR [ID]]``.

    ``FLAVOUR`` is the protocol flavour the rank proved (:func:`~ignite_ext.distributed.store.wire.prove`;
    ``validated`` by default); ``ID`` the rank's :func:`process_identity` as it published it, so that a rank that
    dies while its keeper starts is reported all the same. Once it watches its rank, the keeper writes
    :data:`READY` on its standard output. Returns 0 when it ends (a goodbye, its rank's death reported, or its rank gone
    before it started), 1 when the store is gone. A rank whose proof failed starts no keeper, and logs why.

    Examples:
        A keeper whose rank's process is gone already ends at once.

        >>> from ignite_ext.distributed.liveness.keeper import main
        >>> main(["127.0.0.1", "1", "", "0", "2", str(2**22 + 7), "0", "0.5", "validated"])
        0

    .. versionadded:: 0.3.0
    """
    args = list(argv if argv is not None else sys.argv[1:])
    host, port, prefix, rank, world_size, parent, beats, every = args[:8]
    flavour = args[8] if len(args) > 8 else "validated"
    identity = args[9] if len(args) > 9 else None
    # A Ctrl-C of the job's process group, and the SIGTERM a launcher sends every process of a job (Slurm's scancel
    # and preemption, torchrun's stop), are for the ranks: a rank that handles SIGTERM to checkpoint is still
    # watched, and its keeper leaves when it does (its pidfd, or its goodbye). The rank started this process with
    # them blocked (see IGNORED): one sent while it started is pending, and discarded here.
    for signum in IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)
    try:
        wire = _Lazy(host, int(port), prefix, max(5.0, 6 * float(every)), flavour)
        _keep(wire, int(rank), int(world_size), int(parent), int(beats), float(every), identity)
    except (OSError, ValueError, struct.error):
        return 1  # the store is gone or unreachable (the job is over): there is nothing left to keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
