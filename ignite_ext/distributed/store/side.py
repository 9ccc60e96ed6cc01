"""A store for the scheduler where the backend brings none (Horovod, XLA): a TCPStore hosted by rank 0's process.

With it, the store channel runs on every backend, so ``timeout=``, waits longer than any collective timeout and
dead-rank detection behave as on gloo. It is made once per world, at the first scheduled block, by every rank
together:

1. rank 0 starts a TCPStore server on a free port (``IGNITE_EXT_STORE_PORT`` to pin one);
2. one broadcast of the backend tells every rank its address: ``IGNITE_EXT_STORE_ADDR`` if set, else the host name
   the launcher gave rank 0 (``HOROVOD_HOSTNAME``), else rank 0's host name;
3. every other rank connects (within ``IGNITE_EXT_STORE_CONNECT_TIMEOUT`` seconds, default 30; these variables are
   on the docs' settings page, :doc:`/settings`);
4. one all-reduce of one integer tells every rank whether all of them connected. If one did not (a firewall, a
   name that does not resolve on every host), every rank uses the collective channel instead, and rank 0 logs
   why. The store channel needs every rank.

Cost: one broadcast and one all-reduce of O(1) bytes per rank, once per world; then what the store channel costs.
The server lives in rank 0's process, as under ``env://`` launches: rank 0 keeps it up at exit until the others
have read its last block (see :class:`~ignite_ext.distributed._lingering.Lingering`).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ignite.distributed as idist
import ignite.distributed.utils as idist_utils

from ignite_ext.distributed.store.clients import Store
from ignite_ext.settings import STORE_ADDR, STORE_CONNECT_TIMEOUT, STORE_PORT

if TYPE_CHECKING:  # as Store: declared in the stub of torch's extension, exported by torch.distributed
    from torch._C._distributed_c10d import TCPStore
else:
    from torch.distributed import TCPStore

__all__ = ["SIDE_STORE_MODELS", "existing_side_store", "side_store", "store_address"]

#: The computation models (``idist.model_name()``) without a store of their own.
SIDE_STORE_MODELS = ("horovod-dist", "xla-dist")

# Client calls other than the scheduler's bounded waits: the value torch's own stores use.
_OPERATION_TIMEOUT = timedelta(seconds=300)

# The scheduler's logger, which the caller sets up (``_channel_choice.scheduler_store`` does, before the first call):
# the room imports nothing of the scheduler. Without it set up, the warning still reaches stderr, the info line not.
_log = logging.getLogger("ignite_ext.distributed")

# One per world: the computation model object idist holds while that world lives.
_BY_MODEL: weakref.WeakKeyDictionary[Any, Store | None] = weakref.WeakKeyDictionary()


def store_address() -> str:
    """The host name other ranks use to reach a server in this process (see the module docstring).

    Examples:
        >>> import os
        >>> from ignite_ext.distributed.store.side import store_address
        >>> os.environ["IGNITE_EXT_STORE_ADDR"] = "10.0.0.7"
        >>> store_address()
        '10.0.0.7'
        >>> del os.environ["IGNITE_EXT_STORE_ADDR"]

    .. versionadded:: 0.2.0
    """
    if value := STORE_ADDR.read():
        return value
    if value := os.environ.get("HOROVOD_HOSTNAME", "").strip():
        return value
    return socket.gethostname()


def _serve() -> tuple[Store | None, str]:
    """Rank 0: a server, and its ``host:port`` (or None and the reason it could not start)."""
    try:
        port = STORE_PORT.read()
        server = TCPStore("127.0.0.1", port, None, True, _OPERATION_TIMEOUT, wait_for_workers=False, use_libuv=True)
    except (RuntimeError, ValueError, OSError) as exc:
        return None, f"!no TCPStore server could start on rank 0: {type(exc).__name__}: {exc}".splitlines()[0]
    return server, f"{store_address()}:{server.port}"


def _connect(address: str) -> Store | None:
    host, _, port = address.rpartition(":")
    try:
        client = TCPStore(
            host,
            int(port),
            None,
            False,
            timedelta(seconds=STORE_CONNECT_TIMEOUT.read()),
            wait_for_workers=False,
            use_libuv=True,
        )
    except (RuntimeError, ValueError, OSError):
        return None
    client.set_timeout(_OPERATION_TIMEOUT)
    return client


def existing_side_store() -> Store | None:
    """This world's side-channel store if :func:`side_store` has made it already (no collective: any rank may ask).

    .. versionadded:: 0.3.0
    """
    return _BY_MODEL.get(idist_utils._model)


def side_store() -> Store | None:
    """This world's side-channel store, made at the first call on every rank together; None: use collectives.

    Must be called by every rank, in the same order relative to the backend's other collectives (the scheduler
    calls it on entering its first block). Later calls cost nothing.

    Examples:
        >>> from ignite_ext.distributed.store.side import side_store
        >>> side_store() is None  # no Horovod or XLA world in this process
        True

    .. versionadded:: 0.2.0
    """
    if idist.model_name() not in SIDE_STORE_MODELS or idist.get_world_size() < 2:
        return None
    model = idist_utils._model  # the one handle on "this world" that idist has
    if model in _BY_MODEL:
        return _BY_MODEL[model]
    rank = idist.get_rank()
    store, address = _serve() if rank == 0 else (None, "")
    shared = idist.broadcast(address, src=0)
    assert isinstance(shared, str)
    if shared.startswith("!"):
        reason = shared[1:]
    else:
        if rank != 0:
            store = _connect(shared)
        missing = int(idist.all_reduce(int(store is None)))
        reason = f"{missing} rank(s) could not connect to {shared}" if missing else ""
    if reason:
        store = None
        if rank == 0:
            _log.warning(
                "scheduler: on %s, ranks wait in the backend's collectives, not through a store (%s): timeout= is "
                "not enforced and a dead rank shows as the backend's own error",
                idist.backend(),
                reason,
            )
    elif rank == 0:
        _log.info("scheduler: on %s, ranks wait through a TCPStore at %s", idist.backend(), shared)
    _BY_MODEL[model] = store
    return store
