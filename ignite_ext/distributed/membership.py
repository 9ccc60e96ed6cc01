"""Who is in the job: the store its ranks share, and which ranks the failure detector has declared lost.

For code that coordinates the job's ranks itself, outside a scheduled block (the downloads' relay between hosts
uses both): the store is the one the scheduler waits through, and the lost ranks are those of the detector's cuts
(:mod:`ignite_ext.distributed.liveness`), the same set on every rank, learnt within ``4/3 T`` of the deaths. Asking
costs no request: the heartbeat thread has already read them.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import ignite.distributed as idist

from ignite_ext.distributed.liveness import Heartbeat
from ignite_ext.distributed.store.clients import Store, default_store
from ignite_ext.distributed.store.side import SIDE_STORE_MODELS, existing_side_store

__all__ = ["job_store", "lost_ranks"]


def job_store() -> Store | None:
    """The store every rank of this job reaches, or None (no process group, one rank, or no store to share).

    Native backends: the process group's store (``env://``'s, torchrun's agent's). Horovod and XLA: the store the
    scheduler makes at its first block, once it has run one (None before).

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> idist.job_store() is None  # no process group in this process
        True

    .. versionadded:: 0.3.0
    """
    if idist.get_world_size() < 2:
        return None
    if idist.model_name() in SIDE_STORE_MODELS:
        return existing_side_store()
    return default_store()


def lost_ranks() -> frozenset[int]:
    """The ranks of this job that the failure detector has declared dead (killed, hung or cut off), so far.

    The same set on every rank once it has learnt of the cuts (within ``4/3 T`` of the deaths, see the
    guarantees page); empty outside a job, or before this process beats (from its process group's start, or
    from its first scheduled block when ``IGNITE_EXT_EARLY_HEARTBEAT=0``).

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> idist.lost_ranks()
        frozenset()

    .. versionadded:: 0.3.0
    """
    store = job_store()
    if store is None:
        return frozenset()
    heartbeat = Heartbeat.running(store)
    if heartbeat is None:
        return frozenset()
    return frozenset(rank for cut in heartbeat.cuts() for rank in cut.ranks)
