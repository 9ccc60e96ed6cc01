"""Data helpers for distributed training: race-free downloads, a sharded sampler and a shared sample cache.

.. versionadded:: 0.1.0
"""

from ignite_ext.data.cache import CachedDataset, CacheStats
from ignite_ext.data.download import ChecksumError, DownloadError, download_url
from ignite_ext.data.extract import ArchiveError, extract_archive
from ignite_ext.data.sampler import ShardedDistributedSampler

__all__ = [
    "ArchiveError",
    "CacheStats",
    "CachedDataset",
    "ChecksumError",
    "DownloadError",
    "ShardedDistributedSampler",
    "download_url",
    "extract_archive",
]
