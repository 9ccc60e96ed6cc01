"""A shared-memory sample cache for map-style datasets: :class:`CachedDataset`, and its Engine handler.

The modules of this package:

* ``dataset``: :class:`CachedDataset` and :class:`CacheStats`: load once, serve every worker and rank of a node;
* ``arena``: :class:`~ignite_ext.data.cache.arena.Arena`, one ``/dev/shm`` file per cache: index table, counters,
  bump-allocated data, publish-when-complete (its file layout in ``_mapping``);
* ``shm``: the shared-memory directory: free space, what live caches may still claim, the sweep of stale arenas;
* ``codec``: sample to bytes and back (a pickled skeleton plus the raw bytes of tensors and arrays);
* ``_cow``: copy-on-write views of the cache file, so large buffers are lent, not copied;
* ``handlers``: :class:`CacheStatsHandler`, the per-epoch hit rate into ``engine.state.metrics``.

.. versionadded:: 0.1.0
"""

from ignite_ext.data.cache.dataset import CachedDataset, CacheStats
from ignite_ext.data.cache.handlers import CacheStatsHandler
from ignite_ext.errors import ShmSpaceError

__all__ = ["CacheStats", "CacheStatsHandler", "CachedDataset", "ShmSpaceError"]
