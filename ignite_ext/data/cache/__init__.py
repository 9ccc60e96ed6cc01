"""A shared-memory sample cache for map-style datasets: :class:`CachedDataset`, and its Engine handler.

The modules of this package:

* ``dataset``: :class:`CachedDataset`: load once, serve every worker and rank of a node;
* ``stats``: :class:`CacheStats`, the hits of each tier (RAM, disk) and the misses;
* ``tiers``: the RAM arena, then the optional disk arena: placement, lookup, counting, creation (node setup);
* ``identity``: what a dataset is, for pairing the node caches of ranks: the default ``name=``, the
  construction site and the sampled content;
* ``transforms``: augment after the cache; :class:`FrozenTransformWarning` when the dataset transforms inside it;
* ``arena``: :class:`~ignite_ext.data.cache.arena.Arena`, one ``/dev/shm`` file per cache: index table, counters,
  bump-allocated data, publish-when-complete (its file layout in ``_mapping``);
* ``shm``: the shared-memory directory: free space, what this user's live caches may still claim, the sweep of
  stale arenas, nothing of other users' (the same rules serve the disk tier's directory);
* ``disk``: the disk tier's directory: checks of ``disk_dir``, the network-filesystem heuristic;
* ``_world``: whether this process is one rank of several, asked of ignite only where it can be;
* ``codec``: sample to bytes and back (a pickled skeleton plus the raw bytes of tensors and arrays);
* ``_cow``: copy-on-write views of the cache file, so large buffers are lent, not copied;
* ``handlers``: :class:`CacheStatsHandler`, the per-epoch hit rate into ``engine.state.metrics``.

:class:`CacheStatsHandler` is loaded on first use (PEP 562): a DataLoader worker that unpickles a
:class:`CachedDataset` imports neither ignite nor :mod:`ignite_ext.distributed`, and neither does a process alone
that constructs one (no process group; see ``_world``), so the workers it forks do not pay for them.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ignite_ext.data.cache.dataset import CachedDataset
from ignite_ext.data.cache.disk import NetworkFilesystemWarning
from ignite_ext.data.cache.persist import StaleCacheWarning
from ignite_ext.data.cache.stats import CacheStats
from ignite_ext.data.cache.transforms import FrozenTransformWarning
from ignite_ext.errors import ShmSpaceError

if TYPE_CHECKING:
    from ignite_ext.data.cache.handlers import CacheStatsHandler

__all__ = [
    "CacheStats",
    "CacheStatsHandler",
    "CachedDataset",
    "FrozenTransformWarning",
    "NetworkFilesystemWarning",
    "ShmSpaceError",
    "StaleCacheWarning",
]


def __getattr__(name: str) -> Any:
    if name == "CacheStatsHandler":
        from ignite_ext.data.cache.handlers import CacheStatsHandler

        globals()[name] = CacheStatsHandler  # later lookups do not come back here
        return CacheStatsHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
