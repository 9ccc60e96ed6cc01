"""Errors raised by the rank scheduler.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RankFailedError", "RankFailure"]


@dataclass(frozen=True)
class RankFailure:
    """What one rank reported when its block failed.

    Args:
        rank: global rank whose block raised (or that died).
        exc_type: qualified name of the exception type, e.g. ``"OSError"``.
        message: ``str()`` of the exception, truncated to a few KiB.

    Examples:
        >>> from ignite_ext.distributed import RankFailure
        >>> str(RankFailure(0, "OSError", "disk full"))
        'rank 0: OSError: disk full'

    .. versionadded:: 0.1.0
    """

    rank: int
    exc_type: str
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.exc_type}: {self.message}"


class RankFailedError(RuntimeError):
    """Raised on every rank that waited on (or ran before) a rank whose scheduled block failed.

    The failing rank itself re-raises its own exception; the others raise this error instead of running
    the block, so nobody runs a step that depended on a failed one and nobody hangs.

    Args:
        failures: one entry per failing rank, in rank order.
        context: what this rank was doing when it learnt of the failure.

    Attributes:
        failures: the :class:`RankFailure` entries, sorted by rank.
        ranks: the failing ranks, sorted.

    Examples:
        >>> from ignite_ext.distributed import RankFailedError, RankFailure
        >>> err = RankFailedError([RankFailure(2, "OSError", "disk full")], "waiting for rank 2")
        >>> err.ranks
        (2,)
        >>> isinstance(err, RuntimeError)
        True

    .. versionadded:: 0.1.0
    """

    def __init__(self, failures: Iterable[RankFailure], context: str = "") -> None:
        self.failures: tuple[RankFailure, ...] = tuple(sorted(failures, key=lambda f: f.rank))
        self.ranks: tuple[int, ...] = tuple(f.rank for f in self.failures)
        self.context = context
        details = "; ".join(str(f) for f in self.failures)
        prefix = f"{context}: " if context else ""
        super().__init__(f"{prefix}rank(s) {list(self.ranks)} failed inside the scheduled block ({details})")

    def __reduce__(self) -> tuple[type[RankFailedError], tuple[tuple[RankFailure, ...], str]]:
        return type(self), (self.failures, self.context)
