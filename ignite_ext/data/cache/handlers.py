"""Ignite :class:`~ignite.engine.Engine` handlers for the data helpers.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from ignite.engine import Engine, Events

from ignite_ext.data.cache.dataset import CachedDataset, CacheStats, Reduce

__all__ = ["CacheStatsHandler"]


class CacheStatsHandler:
    """Report a :class:`~ignite_ext.data.CachedDataset`'s hit rate at the end of every epoch.

    At each ``EPOCH_COMPLETED`` it reads :meth:`CachedDataset.stats` (reduced over ``reduce``), logs the epoch's
    hit rate (hits and misses since the previous epoch) with the engine's logger and stores, in
    ``engine.state.metrics``, ``"<name>/hit_rate"``, ``"<name>/hits"`` and ``"<name>/misses"`` (of the epoch) and
    ``"<name>/entries"`` and ``"<name>/bytes"`` (what the cache holds), where metric loggers such as ignite's
    TensorBoard handler pick them up (``metric_names="all"``).

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
        metrics = {
            "hit_rate": epoch.hit_rate,
            "hits": epoch.hits,
            "misses": epoch.misses,
            "entries": now.entries,
            "bytes": now.bytes,
        }
        for key, value in metrics.items():
            engine.state.metrics[f"{self._name}/{key}"] = value
        engine.logger.info(
            "Epoch[%s] %s: hit rate %.1f%% (%d hits, %d misses), %d entries, %d bytes",
            engine.state.epoch,
            self._name,
            100.0 * epoch.hit_rate,
            epoch.hits,
            epoch.misses,
            now.entries,
            now.bytes,
        )
