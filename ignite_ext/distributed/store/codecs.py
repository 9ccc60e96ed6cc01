"""The formats of the values the package keeps in the store, each a named codec: cuts and a block's exit count.

Standard library only: the keeper loads it by its path.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = [
    "COMPLETE",
    "DEATH_ENTERED",
    "LOST",
    "ExitCount",
    "ProgressRecord",
    "cut_ranks",
    "decode_cut",
    "decode_progress",
    "encode_cut",
    "encode_progress",
]

#: A rank's published progress: what, done, total (None: unknown), rate (None: not yet), seconds since it last
#: advanced when published, finished, unit (see :class:`ignite_ext.progress.Progress`).
ProgressRecord = tuple[str, float, float | None, float | None, float, bool, str]

#: Added to a block's ``exits`` for each rank found dead after posting its outcome: it may never have counted its
#: exit. Below it, ``exits`` counts as :class:`ExitCount` says (at most ``N * (N + 2)``, far below ``2**32``).
LOST = 1 << 32
#: Added once to ``exits``, after a loss, by the rank that finds every outcome posted: the block is over.
COMPLETE = 1 << 52
#: Added to a block's ``entered`` by whoever posts a death at the entry as the verdict: above any count of ranks.
DEATH_ENTERED = 1 << 32


def encode_cut(author: int, silent_s: float, ranks: Sequence[int]) -> bytes:
    """A cut as stored: ``<author>|<silence, s>|<rank>,<rank>,...`` (the keeper's cuts have silence 0).

    Examples:
        >>> from ignite_ext.distributed.store.codecs import encode_cut
        >>> encode_cut(1, 3.2, [2, 3])
        b'1|3.200|2,3'

    .. versionadded:: 0.4.0
    """
    return b"%d|%.3f|%s" % (author, silent_s, ",".join(map(str, ranks)).encode())


def decode_cut(payload: bytes) -> tuple[int, float, tuple[int, ...]]:
    """``(author, silence, ranks)`` of a cut stored by :func:`encode_cut`.

    Examples:
        >>> from ignite_ext.distributed.store.codecs import decode_cut
        >>> decode_cut(b"1|3.200|2,3")
        (1, 3.2, (2, 3))

    .. versionadded:: 0.4.0
    """
    author, silent, ranks = payload.decode().split("|")
    return int(author), float(silent), tuple(int(r) for r in ranks.split(","))


def cut_ranks(payload: bytes) -> set[int]:
    """The ranks of a stored cut.

    Examples:
        >>> from ignite_ext.distributed.store.codecs import cut_ranks
        >>> sorted(cut_ranks(b"5|0.000|4,5"))
        [4, 5]

    .. versionadded:: 0.4.0
    """
    return set(decode_cut(payload)[2])


class ExitCount:
    """A block's ``exits`` counter, for ``world_size`` ranks: one ``add`` per exit tells both who left and who failed.

    A rank leaving adds 1, plus ``N + 1`` if it failed (its failure record counted with it); a rank found dead
    after posting its outcome adds :data:`LOST`; the rank that then finds every outcome posted adds
    :data:`COMPLETE` once. So, below :data:`LOST`, ``exits % (N + 1)`` ranks have left and ``exits // (N + 1)``
    failure records were written.

    Examples:
        >>> from ignite_ext.distributed.store.codecs import LOST, ExitCount
        >>> count = ExitCount(3)
        >>> exits = count.exit(failed=False) + count.exit(failed=True) + count.exit(failed=False)
        >>> count.left(exits), count.records(exits)
        (True, 1)
        >>> count.left(count.exit(failed=True)), count.left(LOST + 1), count.lost(LOST + 1)
        (False, False, True)
        >>> count.left(count.complete(LOST + 1))
        True

    .. versionadded:: 0.4.0
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def exit(self, failed: bool) -> int:
        """What one rank's exit adds."""
        return 1 + (self.world_size + 1) * bool(failed)

    def lost(self, exits: int) -> bool:
        """Whether a rank was found dead after posting its outcome (its exit may be missing from the count)."""
        return exits >= LOST

    def complete(self, exits: int) -> int:
        """``exits`` once the block was ended after a loss."""
        return exits + COMPLETE

    def ended_after_a_loss(self, exits: int) -> bool:
        """Whether the block was ended after a loss (every outcome's failures are in one key)."""
        return exits >= COMPLETE

    def all_counted(self, exits: int) -> bool:
        """Whether every rank's exit is counted."""
        return exits % LOST % (self.world_size + 1) == self.world_size

    def left(self, exits: int) -> bool:
        """Whether every rank has left (or the block was ended after a loss)."""
        return self.ended_after_a_loss(exits) or self.all_counted(exits)

    def records(self, exits: int) -> int:
        """How many failure records the failed exits wrote (without a loss; after one, the record counter says)."""
        return exits // (self.world_size + 1)


def encode_progress(record: ProgressRecord) -> bytes:
    """A rank's progress as stored: an ASCII JSON list of :data:`ProgressRecord`'s fields.

    Examples:
        >>> from ignite_ext.distributed.store.codecs import decode_progress, encode_progress
        >>> encode_progress(("downloading a.bin", 5e6, 1e7, 2e6, 0.25, False, "B"))
        b'["downloading a.bin", 5000000.0, 10000000.0, 2000000.0, 0.25, false, "B"]'
        >>> decode_progress(encode_progress(("tokenizing", 3, None, None, 1.5, False, "")))
        ('tokenizing', 3.0, None, None, 1.5, False, '')

    .. versionadded:: 0.4.0
    """
    return json.dumps(list(record)).encode()


def decode_progress(payload: bytes) -> ProgressRecord:
    """The :data:`ProgressRecord` stored by :func:`encode_progress`.

    .. versionadded:: 0.4.0
    """
    what, done, total, rate, since, finished, unit = json.loads(payload.decode())
    return (
        str(what),
        float(done),
        None if total is None else float(total),
        None if rate is None else float(rate),
        float(since),
        bool(finished),
        str(unit),
    )
