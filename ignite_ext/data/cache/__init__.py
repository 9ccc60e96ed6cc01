"""A shared-memory sample cache for map-style datasets: :class:`CachedDataset`, and its Engine handler.

Its modules, one room each, are drawn in the architecture page. :class:`CacheStatsHandler` is loaded on first use
(PEP 562): a DataLoader worker that unpickles a :class:`CachedDataset` imports neither ignite nor
:mod:`ignite_ext.distributed`, and neither does a process alone that constructs one (see ``_world``).

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

# fmt: off
__all__ = [
    "CacheStats", "CacheStatsHandler", "CachedDataset", "FrozenTransformWarning", "NetworkFilesystemWarning",
    "ShmSpaceError", "StaleCacheWarning",
]
# fmt: on


def __getattr__(name: str) -> Any:
    if name == "CacheStatsHandler":
        from ignite_ext.data.cache.handlers import CacheStatsHandler

        globals()[name] = CacheStatsHandler  # later lookups do not come back here
        return CacheStatsHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
