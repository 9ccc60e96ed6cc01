"""The rest of an epoch after a change of world size, as pure functions: :func:`unconsumed_indices`, :func:`restripe`.

An epoch runs in *segments*, one per world it ran on. The first is the epoch as the sampler always deals it:
every rank of the first :class:`~ignite_ext.data.sampler.layout.Layout` yields its fixed shard's order. When the
job stops after every rank consumed ``c`` indices of its order (ranks train in lockstep, so it is the same ``c``
on all of them) and comes back on another world, the indices that no rank consumed (:func:`unconsumed_indices`,
ascending) are dealt over the new layout exactly as a fresh epoch deals ``range(n)``: cut into contiguous,
balanced blocks (one per rank, or one per node), padded or trimmed to equal lengths by the usual rules, shuffled
with ``(seed, epoch, shard, segment)`` (:func:`restripe`). A second change in the same epoch adds a segment the
same way. A segment is therefore named by its layout and its consumed count only: O(1) values per change of
world size, from which every later world recomputes what was consumed.

Why contiguous blocks of the *remaining* indices: each new rank's share of the rest of the epoch is a run of
nearby indices. With ``shuffle`` the consumed indices are spread evenly over every old shard, so a share falls
almost entirely within the rank's new fixed shard, which it keeps from the next epoch on (all but at most
``2 * R / R'`` samples when the old world size ``R`` is a multiple of the new one ``R'``).

Cost: replaying the segments computes every old rank's order: O(n) time and memory per rank, once per resume.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ignite_ext.data.sampler.indices import check_int
from ignite_ext.data.sampler.layout import Layout
from ignite_ext.data.sampler.mixing import epoch_pool

__all__ = ["Segment", "restripe", "unconsumed_indices"]


@dataclass(frozen=True)
class Segment:
    """A part of an epoch that ran on one layout: every rank of it consumed the first ``consumed`` of its order.

    .. versionadded:: 0.2.0
    """

    layout: Layout
    consumed: int


def unconsumed_indices(
    n: int, segments: Sequence[Segment], *, seed: int, epoch: int, drop_last: bool, shuffle: bool, mix: float = 0.0
) -> list[int]:
    """Return the indices of an epoch that no rank consumed in ``segments``, ascending.

    Segment ``i`` deals what segments ``0 .. i-1`` left (segment 0 deals ``range(n)``); its ranks each consumed
    the first ``consumed`` indices of their order. A segment consumed to its end finishes the epoch: nothing is
    left, even with ``drop_last=True`` where the segment left some samples out.

    Args:
        n: dataset size.
        segments: the epoch's segments so far, oldest first.
        seed: base seed.
        epoch: epoch number.
        drop_last: the sampler's ``drop_last``.
        shuffle: the sampler's ``shuffle``.
        mix: the sampler's ``mix``: segment 0 deals the epoch's mixed shards
            (:func:`~ignite_ext.data.sampler.mixing.epoch_pool` of its layout).

    Returns:
        The remaining indices, ascending.

    Raises:
        ValueError: a segment's ``consumed`` is negative or more than its ranks' length.

    Examples:
        >>> from ignite_ext.data.sampler.layout import Layout
        >>> from ignite_ext.data.sampler.restripe import Segment, unconsumed_indices
        >>> unconsumed_indices(12, [Segment(Layout(4), 2)], seed=0, epoch=0, drop_last=False, shuffle=False)
        [2, 5, 8, 11]

    .. versionadded:: 0.2.0
    """
    n = check_int("n", n, 0)
    pool: Sequence[int] = range(n)
    if segments:
        pool = epoch_pool(n, segments[0].layout.shards, seed, epoch, mix)
    for number, segment in enumerate(segments):
        length = segment.layout.length(len(pool), drop_last)
        consumed = check_int("consumed", segment.consumed, 0)
        if consumed > length:
            raise ValueError(
                f"segment {number} of epoch {epoch} ({segment.layout.num_replicas} ranks) says consumed={consumed}, "
                f"but its ranks yield only {length} indices each"
            )
        if consumed == length:
            pool = []
            continue
        seen = bytearray(n)
        orders = segment.layout.orders(
            pool, seed=seed, epoch=epoch, drop_last=drop_last, shuffle=shuffle, segment=number
        )
        for order in orders:
            for idx in order[:consumed]:
                seen[idx] = 1
        # Sorted, as :func:`restripe` dealt it to the next segment: segment 0's mixed pool is not in index order,
        # and replaying a later segment from an unsorted pool names other samples than its ranks consumed.
        pool = sorted(idx for idx in pool if not seen[idx])
    return list(pool)


def restripe(
    n: int,
    segments: Sequence[Segment],
    layout: Layout,
    shard: int,
    local: int = 0,
    *,
    seed: int,
    epoch: int,
    drop_last: bool,
    shuffle: bool,
    mix: float = 0.0,
) -> list[int]:
    """Return what the rank at ``(shard, local)`` of ``layout`` yields for the rest of an epoch.

    The rest (:func:`unconsumed_indices` of ``segments``) is dealt over ``layout`` as segment ``len(segments)``:
    contiguous balanced blocks of it per shard, padded (``drop_last=False``) or trimmed (``drop_last=True``) to
    :meth:`Layout.length <ignite_ext.data.sampler.layout.Layout.length>` of it, shuffled. With no segments this
    is the rank's fresh epoch (``shard_indices`` / ``node_shard_indices``).

    Args:
        n: dataset size.
        segments: the epoch's earlier segments, oldest first.
        layout: the world that deals the rest.
        shard: this rank's shard (its rank, or its node).
        local: this rank's local rank in its node (0 with ``shard_by="rank"``).
        seed: base seed.
        epoch: epoch number.
        drop_last: the sampler's ``drop_last``.
        shuffle: the sampler's ``shuffle``.
        mix: the sampler's ``mix`` (with no segments, the epoch's mixed shards are dealt).

    Returns:
        This rank's indices for the rest of the epoch; every rank of ``layout`` gets as many.

    Raises:
        ValueError: a segment is inconsistent (see :func:`unconsumed_indices`) or the rank is out of range.

    Examples:
        >>> from ignite_ext.data.sampler.layout import Layout
        >>> from ignite_ext.data.sampler.restripe import Segment, restripe
        >>> before = [Segment(Layout(4), 2)]  # 4 ranks each consumed 2 of their 3 indices
        >>> [restripe(12, before, Layout(2), r, seed=0, epoch=0, drop_last=False, shuffle=False) for r in range(2)]
        [[2, 5], [8, 11]]

    .. versionadded:: 0.2.0
    """
    n = check_int("n", n, 0)
    pool: Sequence[int]
    if segments:
        pool = unconsumed_indices(n, segments, seed=seed, epoch=epoch, drop_last=drop_last, shuffle=shuffle, mix=mix)
    else:
        pool = epoch_pool(n, layout.shards, seed, epoch, mix)
    return layout.order(
        pool,
        shard,
        local,
        seed=seed,
        epoch=epoch,
        drop_last=drop_last,
        shuffle=shuffle,
        segment=len(segments),
    )
