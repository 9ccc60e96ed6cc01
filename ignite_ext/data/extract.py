"""Former home of :func:`~ignite_ext.data.download.extract_archive`: its names, for code that imports them from here.

.. versionadded:: 0.1.0
.. deprecated:: 0.2.0
    Import from :mod:`ignite_ext.data.download` (or :mod:`ignite_ext.data`).
"""

from ignite_ext.data.download.extract import DEFAULT_MAX_TOTAL_BYTES, archive_stem, extract_archive
from ignite_ext.errors import ArchiveError

__all__ = ["DEFAULT_MAX_TOTAL_BYTES", "ArchiveError", "archive_stem", "extract_archive"]
