"""Errors raised by the rank scheduler (they live in :mod:`ignite_ext.errors`, the package's one error root).

.. versionadded:: 0.1.0
"""

from ignite_ext.errors import (
    CollectiveError,
    RankDiedError,
    RankFailedError,
    RankFailure,
    RankStalledError,
    StoreLostError,
)

__all__ = ["CollectiveError", "RankDiedError", "RankFailedError", "RankFailure", "RankStalledError", "StoreLostError"]
