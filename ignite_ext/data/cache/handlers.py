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

    At each ``EPOCH_COMPLETED`` it reads :meth:`CachedDataset.stats` (reduced over ``reduce``), logs the epoch's
    hit rate (hits and misses since the previous epoch; with a disk tier, the hits of each tier) with the engine's
    logger and stores, in ``engine.state.metrics``, where metric loggers such as ignite's TensorBoard handler pick
    them up (``metric_names="all"``):

    * of the epoch: ``"<name>/hit_rate"``, ``"<name>/hits"`` and ``"<name>/misses"``, and per tier
      ``"<name>/ram_hits"``, ``"<name>/disk_hits"``, ``"<name>/ram_hit_rate"``, ``"<name>/disk_hit_rate"`` and
      ``"<name>/miss_rate"`` (the three rates sum to 1);
    * what the cache holds: ``"<name>/entries"`` and ``"<name>/bytes"`` (both tiers), ``"<name>/disk_entries"``
      and ``"<name>/disk_bytes"``.

    The per-tier metrics are there with or without a disk tier (then the disk ones are 0).

    With ``reduce="node"`` or ``"world"`` the stats are a collective: attach the handler on every rank.

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
        """Run at every ``EPOCH_COMPLETED`` of ``engine``, writing metrics prefixed ``"<name>/"``.

        Args:
            engine: the engine whose epochs consume ``dataset``.
            name: prefix of the metric names.
        """
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
        head = (engine.state.epoch, self._name, 100.0 * epoch.hit_rate, epoch.hits)
        if self.dataset.disk_dir is None:
            engine.logger.info(
                "Epoch[%s] %s: hit rate %.1f%% (%d hits, %d misses), %d entries, %d bytes",
                *head,
                epoch.misses,
                now.entries,
                now.bytes,
            )
            return
        engine.logger.info(
            "Epoch[%s] %s: hit rate %.1f%% (%d hits: %d from RAM, %d from disk; %d misses), "
            "%d entries (%d on disk), %d bytes (%d on disk)",
            *head,
            epoch.ram_hits,
            epoch.disk_hits,
            epoch.misses,
            now.entries,
            now.disk_entries,
            now.bytes,
            now.disk_bytes,
        )
