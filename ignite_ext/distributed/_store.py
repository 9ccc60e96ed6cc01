"""The scheduler's store protocol: which store it uses, and every key it writes there, with its lifetime.

The store is the process group's :class:`torch.distributed.Store` (the TCPStore of ``env://`` and torchrun
launches, served by one process, rank 0's under ``env://``). Values are ASCII text (JSON or decimal counters).

Every key lives under ``ignite_ext/``; this module is the only place that spells one. The kinds:

.. code-block:: text

    key                                  written by              deleted                          size
    ignite_ext/hb/<rank>                 rank's heartbeat thread never (one per rank per store)   counter
                                         (add; its watcher adds 0
                                         to create it)
    ignite_ext/cuts                      whoever posts a cut     never (one per store)            counter
                                         (compare_set i-1 -> i)
    ignite_ext/cut/<i>                   the first proposer of   never (a few per failed job)     cut text
                                         cut i, once
    ignite_ext/sched/<seq>/entry/<rank>  rank, on entering       by rank, after block seq+1's verdict   entry JSON
    ignite_ext/sched/<seq>/entered       every rank (add)        by rank 0, idem                  counter
    ignite_ext/sched/<seq>/verdict       the last rank to enter  by rank 0, idem                  verdict JSON
    ignite_ext/sched/<seq>/out/<rank>    rank (or who declares   by rank, idem                    outcome JSON
                                         it dead), once
    ignite_ext/sched/<seq>/exits         every rank (add)        by rank 0, idem                  counter
    ignite_ext/sched/<seq>/nfail         failing ranks (add)     by rank 0, idem                  counter
    ignite_ext/sched/<seq>/fail/<i>      the i-th failing rank   by that rank, idem               failures JSON
    ignite_ext/sched/<seq>/acks          every rank but 0 (add,  by rank 0, idem                  counter
                                         at its next beat)
    ignite_ext/sched/<seq>/acked         the last rank to ack    by rank 0, idem                  "1"
    ignite_ext/sched/<seq>/wake/<rank>/<phase>  whoever completes by rank, idem                   "w"/"t"
                                         what rank waits for in
                                         that phase (the verdict,
                                         its turn, every exit), or
                                         its heartbeat at a slice
                                         end
    ignite_ext/sched/<seq>/lost/<rank>   who finds rank silent   by that rank, idem               "1"
                                         after it posted its
                                         outcome, once
    ignite_ext/sched/<seq>/complete      who finds every outcome by rank 0, idem                  failures JSON
                                         posted after a loss

A block's keys are deleted only once the next block's verdict is known: block ``seq + 1`` is judged only after
every rank entered it, which proves every rank left block ``seq``. So at most two blocks' keys exist at a time.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch declares it in the stub of its extension, and exports it as torch.distributed.Store
    from torch._C._distributed_c10d import Store
else:
    from torch.distributed import Store

__all__ = [
    "CUTS_KEY",
    "PHASES",
    "BlockKeys",
    "Store",
    "ack",
    "client_of_this_thread",
    "clone",
    "cut_key",
    "default_store",
    "forget_client_of_this_thread",
    "heartbeat_key",
    "put",
    "put_once",
    "read",
]

_ROOT = "ignite_ext"


def heartbeat_key(rank: int) -> str:
    """The counter ``rank``'s heartbeat thread bumps while the process lives.

    Examples:
        >>> from ignite_ext.distributed._store import heartbeat_key
        >>> heartbeat_key(3)
        'ignite_ext/hb/3'

    .. versionadded:: 0.2.0
    """
    return f"{_ROOT}/hb/{rank}"


#: How many cuts (ranks declared dead together) the group has: see :mod:`ignite_ext.distributed.liveness`.
CUTS_KEY = f"{_ROOT}/cuts"

#: The phases of a block in which a rank may wait, each with its own wake key: for the verdict (entry), for the ranks
#: its turn comes after (turn), for every rank to leave (exit).
PHASES = ("entry", "turn", "exit")


def cut_key(index: int) -> str:
    """The ranks of the group's ``index``-th cut (1-based), written once by the first rank that proposed it.

    Examples:
        >>> from ignite_ext.distributed._store import cut_key
        >>> cut_key(1)
        'ignite_ext/cut/1'

    .. versionadded:: 0.3.0
    """
    return f"{_ROOT}/cut/{index}"


class BlockKeys:
    """The keys of scheduled block number ``seq`` (see the module docstring for who writes and deletes each).

    Args:
        seq: the block's sequence number in its process group.

    Examples:
        >>> from ignite_ext.distributed._store import BlockKeys
        >>> keys = BlockKeys(7)
        >>> keys.outcome(2), keys.exits
        ('ignite_ext/sched/7/out/2', 'ignite_ext/sched/7/exits')
        >>> len(keys.deleted_by(0)), len(keys.deleted_by(1))
        (12, 5)

    .. versionadded:: 0.2.0
    """

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.prefix = f"{_ROOT}/sched/{seq}"
        self.entered = f"{self.prefix}/entered"
        self.verdict = f"{self.prefix}/verdict"
        self.exits = f"{self.prefix}/exits"
        self.nfail = f"{self.prefix}/nfail"
        self.acks = f"{self.prefix}/acks"
        self.acked = f"{self.prefix}/acked"
        self.complete = f"{self.prefix}/complete"

    def entry(self, rank: int) -> str:
        """What ``rank`` passed on entering, for the last rank to enter to judge."""
        return f"{self.prefix}/entry/{rank}"

    def outcome(self, rank: int) -> str:
        """``rank``'s outcome: the failures it reports (empty when it succeeded); written once."""
        return f"{self.prefix}/out/{rank}"

    def fail(self, index: int) -> str:
        """The details of the ``index``-th failing rank (1-based, in the order they failed)."""
        return f"{self.prefix}/fail/{index}"

    def lost(self, rank: int) -> str:
        """Set by the rank that found ``rank`` silent after it had posted its outcome (it may not have left)."""
        return f"{self.prefix}/lost/{rank}"

    def wake(self, rank: int, phase: str) -> str:
        """The key ``rank`` blocks on while it waits in ``phase``; set by whoever completes what it waits for.

        One key per phase of the block (:data:`PHASES`): a waiter woken for what it waited for returns without
        deleting its key, which no later wait of the block uses.
        """
        return f"{self.prefix}/wake/{rank}/{phase}"

    def deleted_by(self, rank: int) -> list[str]:
        """The keys of this block that ``rank`` deletes (its ``fail/<i>`` keys aside, which only it knows of)."""
        own = [self.outcome(rank), self.entry(rank), *(self.wake(rank, phase) for phase in PHASES)]
        shared = [self.exits, self.nfail, self.acks, self.acked, self.entered, self.verdict, self.complete]
        return [*own, *shared] if rank == 0 else own


def default_store() -> Store | None:
    """The default process group's store, or None when there is none (not initialised, or torch hides it).

    torch has no public way to reach it: this is the one place that uses the private
    ``torch.distributed.distributed_c10d._get_default_store``, and a test fails if torch renames or changes it.

    Examples:
        >>> from ignite_ext.distributed._store import default_store
        >>> default_store() is None  # no process group in this process
        True

    .. versionadded:: 0.2.0
    """
    from torch.distributed import distributed_c10d

    if not distributed_c10d.is_initialized():
        return None
    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, ValueError, RuntimeError):
        return None


# pybind's Store takes bytes wherever its stub says str: values here are bytes, so the casts live in these three.
_ABSENT = "\x00"  # compare_set on a missing key with this expected value reads without writing


def put(store: Store, key: str, value: bytes) -> None:
    """Set ``key`` to ``value``.

    .. versionadded:: 0.2.0
    """
    store.set(key, value)  # type: ignore[arg-type]


def read(store: Store, key: str) -> bytes | None:
    """The value of ``key``, or None when it is not set (one request, and it never blocks).

    .. versionadded:: 0.2.0
    """
    value = bytes(store.compare_set(key, _ABSENT, "-"))
    return None if value == _ABSENT.encode() else value


def put_once(store: Store, key: str, value: bytes) -> bool:
    """Set ``key`` to ``value`` unless it is set already; True when this call set it.

    Of several callers writing different values, exactly one is told it won.

    .. versionadded:: 0.2.0
    """
    return bytes(store.compare_set(key, "", value)) == value  # type: ignore[arg-type]


def ack(store: Store, acks: str, acked: str, expected: int) -> None:
    """Count one acknowledgement of a block's outcome in ``acks``; the one that makes ``expected`` sets ``acked``.

    At least ``expected``: a rank lost while leaving may have acknowledged before it died, and then been
    acknowledged for by the rank that declared it.

    Examples:
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed._store import ack, read
        >>> store = dist.HashStore()
        >>> ack(store, "acks", "acked", 2); read(store, "acked")
        >>> ack(store, "acks", "acked", 2); read(store, "acked")
        b'1'

    .. versionadded:: 0.3.0
    """
    if store.add(acks, 1) >= expected:
        put(store, acked, b"1")


def clone(store: Store) -> Store:
    """A client of its own to ``store`` (a blocked ``wait`` holds its client's lock), or ``store`` itself.

    .. versionadded:: 0.3.0
    """
    try:
        return store.clone()  # type: ignore[attr-defined,no-any-return]
    except (AttributeError, RuntimeError):  # a store that cannot be cloned (HashStore): share it
        return store


_THREAD_CLIENTS = threading.local()


def _clients_of_this_thread() -> weakref.WeakKeyDictionary[Store, Store]:
    clients: weakref.WeakKeyDictionary[Store, Store] | None = getattr(_THREAD_CLIENTS, "clients", None)
    if clients is None:
        clients = _THREAD_CLIENTS.clients = weakref.WeakKeyDictionary()
    return clients


def client_of_this_thread(store: Store) -> Store:
    """This thread's own client of ``store``, so that other threads' requests never wait behind its waits.

    .. versionadded:: 0.3.0
    """
    clients = _clients_of_this_thread()
    client = clients.get(store)
    if client is None:
        client = clients[store] = clone(store)
    return client


def forget_client_of_this_thread(store: Store) -> None:
    """Drop this thread's client of ``store`` (a call of it is stuck): the next block clones a new one.

    .. versionadded:: 0.3.0
    """
    _clients_of_this_thread().pop(store, None)
