"""ignite_ext: rank scheduling, race-free downloads and cached DDP data loading for PyTorch-Ignite.

``import ignite_ext.distributed as idist`` is a drop-in superset of ``ignite.distributed``;
``ignite_ext.data`` holds the download, sampler and cache helpers.

.. versionadded:: 0.1.0
"""

from ignite_ext._version import __version__

__all__ = ["__version__"]
