"""Data helpers for distributed training: race-free downloads, a sharded sampler and a shared sample cache.

One subpackage per capability: :mod:`ignite_ext.data.download` (standard library only: no torch, no numpy),
:mod:`ignite_ext.data.sampler` and :mod:`ignite_ext.data.cache`. The names below are loaded on first use
(PEP 562), so ``import ignite_ext.data`` costs nothing, and using only the download helpers never imports torch.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ignite_ext.data.cache import (
        CachedDataset,
        CacheStats,
        CacheStatsHandler,
        FrozenTransformWarning,
        NetworkFilesystemWarning,
    )
    from ignite_ext.data.download import download_for_job, download_url, extract_archive
    from ignite_ext.data.fork_safety import ForkDeadlockWarning
    from ignite_ext.data.sampler import SamplerHandler, ShardedDistributedSampler
    from ignite_ext.errors import ArchiveError, ChecksumError, DownloadError, ShmSpaceError

__all__ = [
    "ArchiveError",
    "CacheStats",
    "CacheStatsHandler",
    "CachedDataset",
    "ChecksumError",
    "DownloadError",
    "ForkDeadlockWarning",
    "FrozenTransformWarning",
    "NetworkFilesystemWarning",
    "SamplerHandler",
    "ShardedDistributedSampler",
    "ShmSpaceError",
    "download_for_job",
    "download_url",
    "extract_archive",
]

# Where each public name lives: the module is imported when the name is first asked for.
_HOMES = {
    "ArchiveError": "ignite_ext.errors",
    "ChecksumError": "ignite_ext.errors",
    "DownloadError": "ignite_ext.errors",
    "ShmSpaceError": "ignite_ext.errors",
    "download_for_job": "ignite_ext.data.download",
    "download_url": "ignite_ext.data.download",
    "extract_archive": "ignite_ext.data.download",
    "SamplerHandler": "ignite_ext.data.sampler",
    "ShardedDistributedSampler": "ignite_ext.data.sampler",
    "CacheStats": "ignite_ext.data.cache",
    "CacheStatsHandler": "ignite_ext.data.cache",
    "CachedDataset": "ignite_ext.data.cache",
    "FrozenTransformWarning": "ignite_ext.data.cache",
    "NetworkFilesystemWarning": "ignite_ext.data.cache",
    "ForkDeadlockWarning": "ignite_ext.data.fork_safety",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
