"""What a cache counts: :class:`CacheStats`, the reads served by each tier (RAM, disk) and the misses.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["CacheStats"]


@dataclass(frozen=True)
class CacheStats:
    """Counters of a :class:`~ignite_ext.data.CachedDataset`, over both of its tiers.

    ``hits``, ``entries`` and ``bytes`` count both tiers; the ``disk_*`` fields the disk tier's share, the ``ram_*``
    properties the rest. Every read is exactly one of a RAM hit, a disk hit or a miss.

    Args:
        hits: reads served from the cache (RAM or disk).
        misses: reads that loaded from the wrapped dataset (stored or not).
        entries: samples stored in the cache (by the processes counted), in either tier.
        bytes: bytes of those samples in the cache.
        disk_hits: the reads among ``hits`` served from the disk tier.
        disk_entries: the samples among ``entries`` stored in the disk tier.
        disk_bytes: the bytes among ``bytes`` stored in the disk tier.
        evictions: entries evicted because they left the shard the cache follows
            (:meth:`~ignite_ext.data.CachedDataset.follow`).
        evicted_bytes: the bytes of those entries.
        loaded_ahead: samples loaded and stored ahead of their first read (``follow(..., ahead=...)``): not reads.

    Examples:
        >>> from ignite_ext.data import CacheStats
        >>> s = CacheStats(hits=3, misses=1, entries=1, bytes=128)
        >>> s.hit_rate
        0.75
        >>> s - CacheStats(hits=1, misses=1, entries=1, bytes=128)
        CacheStats(hits=2, misses=0, entries=0, bytes=0, disk_hits=0, disk_entries=0, disk_bytes=0, ...)
        >>> tiered = CacheStats(hits=6, misses=2, entries=4, bytes=512, disk_hits=2, disk_entries=1, disk_bytes=128)
        >>> tiered.ram_hits, tiered.ram_hit_rate, tiered.disk_hit_rate, tiered.miss_rate
        (4, 0.5, 0.25, 0.25)

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``disk_hits``, ``disk_entries``, ``disk_bytes`` and the per-tier properties.
    .. versionchanged:: 0.4.0
       ``evictions``, ``evicted_bytes`` and ``loaded_ahead``.
    """

    hits: int = 0
    misses: int = 0
    entries: int = 0
    bytes: int = 0
    disk_hits: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    loaded_ahead: int = 0

    @property
    def reads(self) -> int:
        """``hits + misses``: every read counted."""
        return self.hits + self.misses

    @property
    def ram_hits(self) -> int:
        """Reads served from the RAM tier: ``hits - disk_hits``."""
        return self.hits - self.disk_hits

    @property
    def ram_entries(self) -> int:
        """Samples stored in the RAM tier: ``entries - disk_entries``."""
        return self.entries - self.disk_entries

    @property
    def ram_bytes(self) -> int:
        """Bytes stored in the RAM tier: ``bytes - disk_bytes``."""
        return self.bytes - self.disk_bytes

    def _share(self, count: int) -> float:
        return count / self.reads if self.reads else 0.0

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)`` (either tier), or 0.0 before any read."""
        return self._share(self.hits)

    @property
    def ram_hit_rate(self) -> float:
        """The share of reads served from RAM, or 0.0 before any read."""
        return self._share(self.ram_hits)

    @property
    def disk_hit_rate(self) -> float:
        """The share of reads served from the disk tier, or 0.0 before any read."""
        return self._share(self.disk_hits)

    @property
    def miss_rate(self) -> float:
        """The share of reads that loaded from the wrapped dataset, or 0.0 before any read."""
        return self._share(self.misses)

    def __sub__(self, other: CacheStats) -> CacheStats:
        return CacheStats(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))
