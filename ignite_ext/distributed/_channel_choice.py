"""Which channel runs the scheduler's protocol here, and on which store (the channels do not import this module).

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import ignite.distributed as idist

from ignite_ext.distributed._channel import Channel, log
from ignite_ext.distributed._collective import CollectiveChannel
from ignite_ext.distributed._state import GroupState
from ignite_ext.distributed._store_channel import StoreChannel
from ignite_ext.distributed.store.clients import Store, default_store
from ignite_ext.distributed.store.side import side_store
from ignite_ext.settings import SCHEDULER_CHANNEL

__all__ = ["make_channel", "scheduler_store"]


def scheduler_store() -> Store | None:
    """The store the store channel uses here, or None where the collective channel runs.

    Native backends: the process group's store. Horovod and XLA: the side-channel store of
    :mod:`ignite_ext.distributed.store.side` (made by every rank together on the first call).
    """
    if SCHEDULER_CHANNEL.read() == "collective":
        return None
    if idist.model_name() != "native-dist":
        log()  # set up before the side store says which channel runs (it logs on this logger, without importing it)
        return side_store()
    return default_store()


def make_channel(
    store: Store | None, state: GroupState, rank: int, world_size: int, label: str, timeout: float | None, seq: int
) -> Channel:
    """The store channel when ``store`` is given, the collective one otherwise."""
    if store is None:
        return CollectiveChannel(rank, world_size, label, timeout)
    return StoreChannel(rank, world_size, label, timeout, store, seq, state)
