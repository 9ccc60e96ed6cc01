"""Former home of :class:`~ignite_ext.data.cache.CacheStatsHandler`, for code that imports it from here.

.. versionadded:: 0.1.0
.. deprecated:: 0.2.0
    Import from :mod:`ignite_ext.data.cache` (or :mod:`ignite_ext.data`).
"""

from ignite_ext.data.cache.handlers import CacheStatsHandler

__all__ = ["CacheStatsHandler"]
