"""The index maths of :class:`~ignite_ext.data.ShardedDistributedSampler`, as pure functions.

Every function is a function of ``(n, num_shards, shard, seed, epoch, drop_last, shuffle)`` only, so it can be checked
without processes: :func:`shard_bounds` (each shard's contiguous range), :func:`samples_per_replica` (the length
every rank yields), :func:`shard_indices` (one shard's order in one epoch), :func:`node_shard_indices` (a node's
shard dealt to its ranks), and :func:`pool_order`, which both deal with: one shard's order cut from any ascending
pool of indices (``range(n)``, or the rest of an epoch restriped over another world).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import SupportsIndex, cast

import torch

__all__ = [
    "check_index",
    "check_int",
    "node_shard_indices",
    "pool_order",
    "samples_per_replica",
    "shard_bounds",
    "shard_indices",
]


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an ``int`` (numpy and torch integers accepted), or ``TypeError``/``ValueError`` naming ``name``.

    Examples:
        >>> from ignite_ext.data.sampler.indices import check_int
        >>> check_int("epoch", 3)
        3
        >>> check_int("epoch", 1.5)
        Traceback (most recent call last):
        ...
        TypeError: epoch must be an int, got float: 1.5

    .. versionadded:: 0.2.0
    """
    # operator.index accepts numpy and torch integers (an epoch counter often is one) and refuses floats; bool is
    # refused separately because True as a rank or a size is always a mistake.
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def check_index(name: str, value: object, size_name: str, size: int) -> int:
    """``value`` as an ``int`` in ``[0, size)``, or ``TypeError``/``ValueError`` naming ``name`` and ``size_name``.

    Examples:
        >>> from ignite_ext.data.sampler.indices import check_index
        >>> check_index("rank", 1, "num_replicas", 2)
        1

    .. versionadded:: 0.2.0
    """
    value = check_int(name, value)
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is out of range for {size_name}={size} (expected 0 <= {name} < {size})")
    return value


def shard_bounds(n: int, num_shards: int, shard: int) -> tuple[int, int]:
    """Return the half-open range ``[start, stop)`` of dataset indices owned by one shard.

    The ``n`` indices are cut into ``num_shards`` contiguous blocks whose sizes differ by at most one; the
    first ``n % num_shards`` blocks hold the extra sample. With ``n < num_shards`` the last shards are empty.

    Args:
        n: dataset size, ``>= 0``.
        num_shards: number of shards, ``>= 1``.
        shard: which shard, ``0 <= shard < num_shards``.

    Returns:
        ``(start, stop)`` with ``stop - start`` equal to ``n // num_shards`` or one more.

    Raises:
        ValueError: an argument is out of range.
        TypeError: an argument is not an int.

    Examples:
        >>> from ignite_ext.data.sampler import shard_bounds
        >>> [shard_bounds(10, 3, s) for s in range(3)]
        [(0, 4), (4, 7), (7, 10)]
        >>> shard_bounds(2, 4, 3)
        (2, 2)

    .. versionadded:: 0.1.0
    """
    n = check_int("n", n, 0)
    num_shards = check_int("num_shards", num_shards, 1)
    shard = check_index("shard", shard, "num_shards", num_shards)
    base, extra = divmod(n, num_shards)
    start = shard * base + min(shard, extra)
    return start, start + base + (1 if shard < extra else 0)


def samples_per_replica(n: int, num_replicas: int, drop_last: bool = False) -> int:
    """Return how many indices every replica yields per epoch: ``ceil(n / R)``, or ``floor(n / R)`` with ``drop_last``.

    This is the same length as :class:`torch.utils.data.DistributedSampler` gives, so swapping samplers keeps
    the number of iterations per epoch.

    Args:
        n: dataset size, ``>= 0``.
        num_replicas: number of replicas ``R``, ``>= 1``.
        drop_last: round down instead of up.

    Returns:
        The per-replica, per-epoch number of indices.

    Examples:
        >>> from ignite_ext.data.sampler import samples_per_replica
        >>> samples_per_replica(10, 4), samples_per_replica(10, 4, drop_last=True)
        (3, 2)

    .. versionadded:: 0.1.0
    """
    n = check_int("n", n, 0)
    num_replicas = check_int("num_replicas", num_replicas, 1)
    return n // num_replicas if drop_last else -(-n // num_replicas)


def _shard_seed(seed: int, epoch: int, shard: int, segment: int = 0) -> int:
    # Hash the triple rather than add seed + epoch: with a sum, (seed=0, epoch=1) and (seed=1, epoch=0) would
    # shuffle alike, and shard s of one epoch would collide with shard s-1 of the next. A restriped segment of an
    # epoch (segment >= 1, after a change of world size) hashes a fourth field, so its orders are independent of
    # the segment-0 orders while every fresh epoch keeps the orders it always had.
    key = f"{seed}:{epoch}:{shard}" if segment == 0 else f"{seed}:{epoch}:{shard}:{segment}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def pool_order(
    pool: Sequence[int],
    num_shards: int,
    shard: int,
    length: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    segment: int = 0,
) -> list[int]:
    """Return one shard's ``length`` indices of one epoch, cut from ``pool`` (the epoch's indices).

    The shard owns positions :func:`shard_bounds` ``(len(pool), num_shards, shard)`` of ``pool``; it is padded
    with its own samples or trimmed to ``length`` (a window that moves on each epoch), then shuffled with a
    generator seeded by ``(seed, epoch, shard, segment)``. A fresh epoch is ``pool = range(n)`` with
    ``segment=0`` (what :func:`shard_indices` and :func:`node_shard_indices` yield); the rest of an epoch
    restriped over a new world is the sorted remaining indices with the segment's number
    (:mod:`ignite_ext.data.sampler.restripe`).

    Args:
        pool: the indices to deal: ``range(n)``, a fresh epoch's mixed shards one after another
            (:func:`~ignite_ext.data.sampler.mixing.epoch_pool`), or the rest of an epoch, ascending.
        num_shards: number of shards, ``>= 1``.
        shard: this shard, ``0 <= shard < num_shards``.
        length: how many indices the shard yields, ``>= 0``.
        seed: base seed.
        epoch: epoch number.
        shuffle: shuffle the shard's order.
        segment: which world of the epoch deals ``pool``: 0 for the world the epoch started on.

    Returns:
        ``length`` indices of ``pool``.

    Examples:
        >>> from ignite_ext.data.sampler.indices import pool_order
        >>> pool_order([1, 4, 5, 8, 9], 2, 1, 3, seed=0, epoch=0, shuffle=False)
        [8, 9, 8]

    .. versionadded:: 0.2.0
    """
    size_of_pool = len(pool)
    start, stop = shard_bounds(size_of_pool, num_shards, shard)
    if start == stop and length > 0:
        # An empty shard (only possible when the pool is smaller than num_shards) has nothing of its own to pad
        # with; it borrows one fixed sample so that its set, like every other shard's, is the same in every epoch.
        start, stop = shard % size_of_pool, shard % size_of_pool + 1
    own = pool[start:stop]
    size = len(own)
    if length <= size:
        # Drop a window of positions that moves on by its own width each epoch, so that over ceil(size / drop)
        # epochs every sample of the shard is yielded.
        drop = size - length
        dropped = {(epoch * drop + j) % size for j in range(drop)}
        kept = [idx for pos, idx in enumerate(own) if pos not in dropped]
    else:
        # Pad with the shard's own samples, a different window each epoch, never with another shard's samples.
        pad = length - size
        kept = [*own, *(own[(epoch * pad + j) % size] for j in range(pad))]
    if not shuffle:
        return kept
    generator = torch.Generator()
    generator.manual_seed(_shard_seed(seed, epoch, shard, segment))
    return [kept[i] for i in torch.randperm(length, generator=generator).tolist()]


def shard_indices(
    n: int,
    num_shards: int,
    shard: int,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    shuffle: bool = True,
) -> list[int]:
    """Return the indices one shard yields in one epoch, in order (``shard_by="rank"``).

    The shard is :func:`shard_bounds` ``(n, num_shards, shard)`` in every epoch. It yields exactly
    :func:`samples_per_replica` ``(n, num_shards, drop_last)`` indices:

    * a shard one short of that pads with its own samples, a different one each epoch (``(epoch + j) % size``);
    * a shard one over (``drop_last=True``) leaves out one of its own samples, a different one each epoch, so
      every sample is yielded in all but one of any ``size`` consecutive epochs;
    * an empty shard (``n < num_shards`` and ``drop_last=False``) repeats sample ``shard % n`` in every epoch.

    With ``shuffle`` the order is a permutation drawn from a generator seeded by a hash of
    ``(seed, epoch, shard)``: the same in every process, different between epochs and shards. Without it the
    shard's samples come in ascending order, followed by the padding.

    Args:
        n: dataset size, ``>= 0``.
        num_shards: number of shards (replicas), ``>= 1``.
        shard: this shard, ``0 <= shard < num_shards``.
        seed: base seed, the same on every replica.
        epoch: epoch number.
        drop_last: yield ``floor(n / num_shards)`` instead of ``ceil``.
        shuffle: shuffle the order within the shard.

    Returns:
        The epoch's indices for this shard.

    Examples:
        >>> from ignite_ext.data.sampler import shard_indices
        >>> [shard_indices(10, 3, s, shuffle=False) for s in range(3)]
        [[0, 1, 2, 3], [4, 5, 6, 4], [7, 8, 9, 7]]
        >>> [shard_indices(10, 3, 1, epoch=e, shuffle=False) for e in range(3)]
        [[4, 5, 6, 4], [4, 5, 6, 5], [4, 5, 6, 6]]
        >>> sorted(shard_indices(10, 3, 0, epoch=5))
        [0, 1, 2, 3]

    .. versionadded:: 0.1.0
    """
    length = samples_per_replica(n, num_shards, drop_last)
    shard = check_index("shard", shard, "num_shards", num_shards)
    n = check_int("n", n, 0)
    return pool_order(range(n), num_shards, shard, length, check_int("seed", seed), check_int("epoch", epoch), shuffle)


def node_shard_indices(
    n: int,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    local_rank: int,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    shuffle: bool = True,
) -> list[int]:
    """Return the indices one process yields in one epoch when shards belong to nodes (``shard_by="node"``).

    Node ``node_rank`` owns :func:`shard_bounds` ``(n, nnodes, node_rank)`` in every epoch. Each epoch the node's
    shard is padded or trimmed (same rules as :func:`shard_indices`) to ``nproc_per_node * L`` indices, where
    ``L`` is :func:`samples_per_replica` ``(n, nnodes * nproc_per_node, drop_last)``, shuffled with a generator
    seeded by ``(seed, epoch, node_rank)`` and dealt out strided: local rank ``l`` takes positions
    ``l, l + P, l + 2P, ...``. So every sample a node needs stays on that node, while which of the node's
    processes loads it changes from epoch to epoch.

    Args:
        n: dataset size, ``>= 0``.
        nnodes: number of nodes, ``>= 1``.
        node_rank: this node, ``0 <= node_rank < nnodes``.
        nproc_per_node: processes per node ``P``, ``>= 1`` (the same on every node).
        local_rank: this process on its node, ``0 <= local_rank < P``.
        seed: base seed, the same on every process.
        epoch: epoch number.
        drop_last: yield ``floor(n / (nnodes * P))`` instead of ``ceil``.
        shuffle: shuffle the node's shard before dealing it.

    Returns:
        The epoch's indices for this process.

    Examples:
        >>> from ignite_ext.data.sampler import node_shard_indices
        >>> [node_shard_indices(8, 2, 0, 2, lr, shuffle=False) for lr in range(2)]
        [[0, 2], [1, 3]]
        >>> sorted(node_shard_indices(8, 2, 1, 2, 0) + node_shard_indices(8, 2, 1, 2, 1))
        [4, 5, 6, 7]

    .. versionadded:: 0.1.0
    """
    nnodes = check_int("nnodes", nnodes, 1)
    nproc_per_node = check_int("nproc_per_node", nproc_per_node, 1)
    node_rank = check_index("node_rank", node_rank, "nnodes", nnodes)
    local_rank = check_index("local_rank", local_rank, "nproc_per_node", nproc_per_node)
    length = samples_per_replica(n, nnodes * nproc_per_node, drop_last)
    order = pool_order(
        range(check_int("n", n, 0)),
        nnodes,
        node_rank,
        nproc_per_node * length,
        check_int("seed", seed),
        check_int("epoch", epoch),
        shuffle,
    )
    return order[local_rank::nproc_per_node]
