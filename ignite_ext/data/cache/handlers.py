"""Ignite :class:`~ignite.engine.Engine` handlers for the data helpers.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from ignite.engine import Engine, Events

from ignite_ext.data.cache.dataset import CachedDataset, Reduce
from ignite_ext.data.cache.stats import CacheStats

__all__ = ["CacheStatsHandler"]


class CacheStatsHandler:
    """Report a :class:`~ignite_ext.data.CachedDataset`'s hit rate at the end of every epoch.

    At each ``EPOCH_COMPLETED`` it reads :meth:`CachedDataset.stats` (reduced over ``reduce``: with ``"node"`` or
    ``"world"`` a collective, so attach it on every rank), logs the epoch's hit rate with the engine's logger and
    stores in ``engine.state.metrics`` (where metric loggers such as ignite's TensorBoard handler pick them up):
    of the epoch, ``"<name>/hit_rate"``, ``hits``, ``misses``, ``ram_hits``, ``disk_hits``, ``ram_hit_rate``,
    ``disk_hit_rate`` and ``miss_rate`` (the three rates sum to 1); what the cache holds, ``"<name>/entries"``,
    ``bytes``, ``disk_entries`` and ``disk_bytes`` (the disk ones 0 without a disk tier).

    Args:
        dataset: the cache to report on.
        reduce: ``"rank"``, ``"node"`` or ``"world"``, as in :meth:`CachedDataset.stats`.

    Raises:
        ValueError: ``reduce`` is unknown.

    Examples:
        >>> from ignite.engine import Engine, Events
        >>> from ignite_ext.data import CachedDataset
        >>> from ignite_ext.data.cache import CacheStatsHandler
        >>> ds = CachedDataset(list(range(4)), capacity_bytes=1 << 20)
        >>> engine = Engine(lambda engine, batch: ds[batch])
        >>> CacheStatsHandler(ds).attach(engine, name="cache")
        >>> rates = []
        >>> @engine.on(Events.EPOCH_COMPLETED)
        ... def record(engine):
        ...     rates.append(engine.state.metrics["cache/hit_rate"])
        >>> _ = engine.run(range(4), max_epochs=3)
        >>> rates
        [0.0, 1.0, 1.0]
        >>> ds.close()

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       The per-tier metrics.
    """

    def __init__(self, dataset: CachedDataset, reduce: Reduce = "world") -> None:
        if reduce not in ("rank", "node", "world"):
            raise ValueError(f"reduce must be one of ('rank', 'node', 'world'), got {reduce!r}")
        self.dataset = dataset
        self.reduce: Reduce = reduce
        self._last = CacheStats()
        self._name = "cache"

    def attach(self, engine: Engine, name: str = "cache") -> None:
        """Run at every ``EPOCH_COMPLETED`` of ``engine`` (whose epochs read the dataset), as ``"<name>/"`` metrics."""
        self._name = name
        self._last = self.dataset.stats(self.reduce)  # only what this engine's epochs read counts
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        """Compute the epoch's stats, store them in ``engine.state.metrics`` and log them."""
        now = self.dataset.stats(self.reduce)
        epoch = now - self._last
        self._last = now
        metrics: dict[str, float] = {
            "hit_rate": epoch.hit_rate,
            "hits": epoch.hits,
            "misses": epoch.misses,
            "ram_hits": epoch.ram_hits,
            "disk_hits": epoch.disk_hits,
            "ram_hit_rate": epoch.ram_hit_rate,
            "disk_hit_rate": epoch.disk_hit_rate,
            "miss_rate": epoch.miss_rate,
            "entries": now.entries,
            "bytes": now.bytes,
            "disk_entries": now.disk_entries,
            "disk_bytes": now.disk_bytes,
        }
        for key, value in metrics.items():
            engine.state.metrics[f"{self._name}/{key}"] = value
        hits, entries, nbytes = f"{epoch.hits} hits,", f"{now.entries} entries", f"{now.bytes} bytes"
        if self.dataset.disk_dir is not None:
            hits = f"{epoch.hits} hits: {epoch.ram_hits} from RAM, {epoch.disk_hits} from disk;"
            entries, nbytes = f"{entries} ({now.disk_entries} on disk)", f"{nbytes} ({now.disk_bytes} on disk)"
        head = f"Epoch[{engine.state.epoch}] {self._name}: hit rate {100.0 * epoch.hit_rate:.1f}%"
        engine.logger.info(f"{head} ({hits} {epoch.misses} misses), {entries}, {nbytes}")
