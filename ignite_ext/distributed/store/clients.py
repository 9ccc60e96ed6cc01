"""The package's store clients: which store it uses, its own connections where torch has none, and small helpers.

The store is the process group's :class:`torch.distributed.Store` (the TCPStore of ``env://`` and torchrun
launches, served by one process, rank 0's under ``env://``). Every key the package writes there, with its
lifetime, is in :mod:`ignite_ext.distributed.store.keys`.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch.distributed

from ignite_ext.distributed.store.incarnation import is_scoped, scoped
from ignite_ext.distributed.store.keys import NAMESPACE_KEY, ROOT
from ignite_ext.distributed.store.wire import read

if TYPE_CHECKING:  # torch declares them in the stub of its extension, and exports them from torch.distributed
    from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
else:
    from torch.distributed import PrefixStore, Store, TCPStore

__all__ = [
    "Endpoint",
    "Store",
    "ack",
    "check",
    "client_of_this_thread",
    "clone",
    "default_store",
    "endpoint",
    "forget_client_of_this_thread",
    "group_store",
    "innermost",
    "namespaced",
    "origin",
    "put",
    "put_once",
    "read",
    "timed_out",
]


def group_store() -> Store | None:
    """The store torch made for the default process group, or None (not initialised, or torch hides it).

    torch has no public way to reach it: this is the one place that uses the private
    ``torch.distributed.distributed_c10d._get_default_store``, and a test fails if torch renames or changes it.
    The package's own traffic goes through :func:`default_store`, which is made from it. Under torchrun's agent
    store, a group formed before the package's ``env://`` rendezvous was installed gets its incarnation's prefix
    here (:mod:`~ignite_ext.distributed.store.incarnation`), so the package never reads an earlier attempt's keys.

    Examples:
        >>> from ignite_ext.distributed.store.clients import group_store
        >>> group_store() is None  # no process group in this process
        True

    .. versionadded:: 0.4.0
    """
    from torch.distributed import distributed_c10d

    if not distributed_c10d.is_initialized():
        return None
    try:
        store = distributed_c10d._get_default_store()
    except (AttributeError, ValueError, RuntimeError):
        return None
    with _GUARD:
        if store not in _INCARNATIONS:
            ours = store if is_scoped(store) else scoped(store)
            _INCARNATIONS[store] = None if ours is store else ours  # never the store itself (it would live on)
        known = _INCARNATIONS[store]
        return store if known is None else known


def default_store() -> Store | None:
    """The package's store for the default process group: :func:`namespaced` :func:`group_store`, or None.

    Examples:
        >>> from ignite_ext.distributed.store.clients import default_store
        >>> default_store() is None  # no process group in this process
        True

    .. versionadded:: 0.2.0
    """
    store = group_store()
    return None if store is None else namespaced(store)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """How to open another client of a TCPStore: its server, and the prefix of the package's keys there."""

    host: str
    port: int
    prefix: str  # as PrefixStore takes it ("" for none); on the wire, keys read "/<prefix>/<key>"
    timeout: timedelta

    def connect(self) -> Store:
        """A new client (a connection of its own) to the server, under the prefix."""
        client = TCPStore(self.host, self.port, is_master=False, timeout=self.timeout, wait_for_workers=False)
        return client if not self.prefix else PrefixStore(self.prefix, client)

    @property
    def wire_prefix(self) -> str:
        """What a wire client puts before the package's keys (after TCPStore's own leading ``/``)."""
        return f"{self.prefix}/" if self.prefix else ""


# The package's clients, and how to open more of them. Weak: a destroyed group's store must be free to go.
_ENDPOINTS: weakref.WeakKeyDictionary[Store, Endpoint] = weakref.WeakKeyDictionary()
_NAMESPACED: weakref.WeakKeyDictionary[Store, Store] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()
#: The store of its incarnation for a group's store formed without it (None: the group's store is that store).
_INCARNATIONS: weakref.WeakKeyDictionary[Store, Store | None] = weakref.WeakKeyDictionary()


def innermost(store: Any) -> Any:
    """The store under every prefix store around ``store`` (``store`` itself if it has none).

    Examples:
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import innermost
        >>> hashed = dist.HashStore()
        >>> innermost(dist.PrefixStore("a", dist.PrefixStore("b", hashed))) is hashed
        True

    .. versionadded:: 0.4.0
    """
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def endpoint(store: Store) -> Endpoint | None:
    """How to open another client of ``store``: known for :func:`namespaced` stores and bare TCPStores, else None.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import endpoint
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> endpoint(server).port == server.port, endpoint(dist.PrefixStore("p", server)), endpoint(dist.HashStore())
        (True, None, None)

    .. versionadded:: 0.4.0
    """
    known = _ENDPOINTS.get(store)
    if known is not None:
        return known
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return Endpoint(host, port, "", store.timeout)  # type: ignore[attr-defined]
    return None


class _Lazy:
    """A namespaced client that connects at its first request.

    Each thread that waits uses a :func:`clone` (its own connection), so most processes never send a request
    through this object. A connection costs torch's client a reverse DNS lookup of the server's address, which a
    lossy resolver stalls for seconds when many ranks connect at once: a connection nobody needs, opened by every
    rank at the group's start, adds to that burst. ``origin`` is torch's store it was made from (weakly: it is the
    value of a weak map keyed by that store), which :func:`origin` gives back.
    """

    def __init__(self, place: Endpoint, origin: Store) -> None:
        self._place = place
        self._origin = weakref.ref(origin)
        self._client: Store | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        with self._lock:
            if self._client is None:
                self._client = self._place.connect()
        return getattr(self._client, name)


def namespaced(store: Store) -> Store:
    """The package's own client of the TCPStore behind ``store``, its keys under a namespace of this group's.

    torch's clients of a group's store are not the package's to block: a ``wait`` holds its client's lock, and
    ``Store.clone`` (a client of one's own) exists only in newer torch. So the package opens its own connections
    to the server (:class:`Endpoint`), whatever the torch, and puts its keys under ``ignite_ext-<token>``, where
    the token is the first proposal of the group's processes, written once in the group's own store (one
    ``compare_set`` per process and group): a group restarted on the same server (torchrun's next attempt) has
    other keys under torch's prefix, so another token, and reads nothing of the attempt before it. A store not
    served by a TCPStore (a ``HashStore``, a ``FileStore``) is used as it is. The client connects at its first
    request; :func:`clone` opens a connection of its own per thread that asks.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import clone, namespaced
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> group = dist.PrefixStore("default_pg", server)
        >>> ours = namespaced(group)
        >>> ours is namespaced(group)
        True
        >>> other = clone(ours); other.set("k", "v"); other is ours, ours.get("k")
        (False, b'v')

    .. versionadded:: 0.4.0
    """
    with _GUARD:
        known = _NAMESPACED.get(store)
        if known is not None:
            return known
        if store in _ENDPOINTS:
            return store
        ours = store
        # Where torch clones its stores itself (2.6 and later: Store.clone), its store is used as it is: clients of
        # one's own come from Store.clone, the wire prefix from rank 0's list_keys (liveness.watch).
        served = None if _clones(store) else endpoint(innermost(store))
        if served is not None:
            proposal = secrets.token_hex(8).encode()
            token = bytes(store.compare_set(NAMESPACE_KEY, "", proposal)).decode()  # type: ignore[arg-type]
            place = dataclasses.replace(served, prefix=f"{ROOT}-{token}")
            ours = cast(Store, _Lazy(place, store))
            _ENDPOINTS[ours] = place
            _NAMESPACED[store] = ours  # never the store itself: a value holding its key would keep it alive
        return ours


def origin(store: Store) -> Store:
    """The torch store that ``store`` (a :func:`namespaced` client) was made from, or ``store`` itself.

    What must stay referenced for the server to live where a process hosts it (rank 0's under ``env://``): the
    package's own clients do not keep torch's store object alive.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import namespaced, origin
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> group = dist.PrefixStore("default_pg", server)
        >>> origin(namespaced(group)) is group, origin(group) is group
        (True, True)

    .. versionadded:: 0.4.0
    """
    made_from = store._origin() if isinstance(store, _Lazy) else None
    return made_from if made_from is not None else store


def _clones(store: Store) -> bool:
    """Whether torch's ``store`` gives a client of its own on ``clone()`` (torch 2.6 and later)."""
    return hasattr(store, "clone")


def _forget_namespaces() -> None:
    global _GUARD
    _NAMESPACED.clear()  # a forked child must not share its parent's connections: it opens its own when asked
    _GUARD = threading.Lock()  # another thread may have held it at the fork: nobody would release it here


os.register_at_fork(after_in_child=_forget_namespaces)


#: The error torch's stores raise (``DistStoreError`` from torch 2.2 on; a plain ``RuntimeError`` before). Not in
#: ``__all__``: a public module exports no error class but those of ``ignite_ext.errors``.
StoreError: type[RuntimeError] = getattr(torch.distributed, "DistStoreError", RuntimeError)


def timed_out(exc: BaseException, waited: float | None = None, asked: float | None = None) -> bool:
    """Whether a store error is a ``wait`` that timed out (any torch: the error's type changed, its words did not).

    ``waited``: seconds from the request to the error; ``asked``: the wait's timeout. torch 2.5 builds a timed-out
    wait's message from the connection's peer address and, where that address has no name (reverse DNS failing at
    once, as in containers without a resolver), raises ``DistNetworkError("failed to format addr ...")`` instead:
    that error is a time-out when it came once the timeout had passed (a broken connection fails at once).

    Examples:
        >>> from ignite_ext.distributed.store.clients import timed_out
        >>> timed_out(RuntimeError("Socket Timeout")), timed_out(RuntimeError("Connection reset by peer"))
        (True, False)
        >>> lost = RuntimeError("failed to format addr, unknown family=0")
        >>> timed_out(lost, waited=0.21, asked=0.2), timed_out(lost, waited=0.01, asked=0.2), timed_out(lost)
        (True, False, False)

    .. versionadded:: 0.4.0
    """
    if not isinstance(exc, RuntimeError):
        return False
    if "timeout" in str(exc).lower():
        return True
    unformatted = "failed to format addr" in str(exc)
    return unformatted and waited is not None and asked is not None and waited >= 0.95 * asked


# pybind's Store takes bytes wherever its stub says str: values here are bytes, so the casts live in these (and in
# wire.read, which this module's users import from here).
def put(store: Store, key: str, value: bytes) -> None:
    """Set ``key`` to ``value``.

    .. versionadded:: 0.2.0
    """
    store.set(key, value)  # type: ignore[arg-type]


def check(store: Store, keys: list[str]) -> bool:
    """Whether every key of ``keys`` is set: one ``check``, or one read per key where the store has none.

    torch 2.1's Python stores lack ``check``: there the reads cost ``len(keys)`` requests (only paths of failures
    ask).

    Examples:
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import check
        >>> store = dist.HashStore(); store.set("a", "1")
        >>> check(store, ["a"]), check(store, ["a", "b"])
        (True, False)

    .. versionadded:: 0.4.0
    """
    if hasattr(store, "check"):
        return bool(store.check(keys))
    return all(read(store, key) is not None for key in keys)


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
        >>> from ignite_ext.distributed.store.clients import ack, read
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

    A new connection where :func:`endpoint` knows the server (any torch), else torch's ``Store.clone`` where
    it has one, else ``store`` itself (a ``HashStore``: one process, nothing to block).

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.clients import clone
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> other = clone(server); other.set("k", "v"); other is server, server.get("k")
        (False, b'v')

    .. versionadded:: 0.3.0
    """
    place = endpoint(store)
    if place is not None:
        client = place.connect()
        if place.prefix:
            _ENDPOINTS[client] = place
        return client
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
