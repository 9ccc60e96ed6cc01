"""How an epoch is dealt out over a world: :class:`Layout`, and the sampler's arguments resolved into one.

A layout is ``num_replicas`` ranks holding ``num_shards`` shards: one shard per rank (``shard_by="rank"``), or one
per node, shared by the node's ``nproc_per_node`` ranks (``shard_by="node"``). It is all the index maths needs to
know of a world, so it is also what a saved state records of the world it was saved on
(:mod:`ignite_ext.data.sampler.restripe` replays an epoch's earlier worlds from it).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

import ignite_ext.distributed as idist
from ignite_ext.data.sampler.indices import check_index, check_int, pool_order, samples_per_replica

__all__ = ["SHARD_BY", "Layout", "Placement", "resolve_placement"]

#: The ways of sharding: one shard per rank, or one per node.
SHARD_BY: tuple[str, ...] = ("rank", "node")


@dataclass(frozen=True)
class Layout:
    """``num_replicas`` ranks in ``num_shards`` shards: one per rank, or one per node (``shard_by="node"``).

    Args:
        num_replicas: ranks in the world, ``>= 1``.
        shard_by: ``"rank"`` (then ``num_shards == num_replicas``) or ``"node"``.
        num_shards: shards (nodes with ``shard_by="node"``); default ``num_replicas``. With ``"node"`` it must
            divide ``num_replicas``: every node runs ``num_replicas // num_shards`` processes.

    Raises:
        ValueError: the fields do not describe a world.
        TypeError: a count is not an int.

    Examples:
        >>> from ignite_ext.data.sampler.layout import Layout
        >>> nodes = Layout(4, "node", 2)
        >>> nodes.nproc_per_node, nodes.length(10, drop_last=False)
        (2, 3)
        >>> [nodes.order(range(10), shard, local, seed=0, epoch=0, drop_last=False, shuffle=False)
        ...  for shard in range(2) for local in range(2)]
        [[0, 2, 4], [1, 3, 0], [5, 7, 9], [6, 8, 5]]

    .. versionadded:: 0.2.0
    """

    num_replicas: int
    shard_by: Literal["rank", "node"] = "rank"
    num_shards: int | None = None

    def __post_init__(self) -> None:
        replicas = check_int("num_replicas", self.num_replicas, 1)
        if self.shard_by not in SHARD_BY:
            raise ValueError(f"shard_by must be one of {list(SHARD_BY)}, got {self.shard_by!r}")
        shards = replicas if self.num_shards is None else check_int("num_shards", self.num_shards, 1)
        if self.shard_by == "rank" and shards != replicas:
            raise ValueError(f"shard_by='rank' has one shard per rank: num_shards={shards} != {replicas}")
        if replicas % shards:
            raise ValueError(f"num_replicas={replicas} is not a multiple of the {shards} nodes")
        object.__setattr__(self, "num_replicas", replicas)
        object.__setattr__(self, "num_shards", shards)

    @property
    def shards(self) -> int:
        """How many shards there are (``num_shards``, resolved)."""
        return cast(int, self.num_shards)

    @property
    def nproc_per_node(self) -> int:
        """Ranks per shard: 1 with ``shard_by="rank"``."""
        return self.num_replicas // self.shards

    def length(self, size: int, drop_last: bool) -> int:
        """How many indices every rank yields when ``size`` indices are dealt: ``ceil`` or ``floor(size / R)``."""
        return samples_per_replica(size, self.num_replicas, drop_last)

    def order(
        self,
        pool: Sequence[int],
        shard: int,
        local: int,
        *,
        seed: int,
        epoch: int,
        drop_last: bool,
        shuffle: bool,
        segment: int = 0,
    ) -> list[int]:
        """Return what the rank at ``(shard, local)`` yields when ``pool`` is dealt (see :meth:`orders`)."""
        nproc = self.nproc_per_node
        shard = check_index("shard", shard, "num_shards", self.shards)
        local = check_index("local", local, "nproc_per_node", nproc)
        length = nproc * self.length(len(pool), drop_last)
        return pool_order(pool, self.shards, shard, length, seed, epoch, shuffle, segment)[local::nproc]

    def orders(
        self, pool: Sequence[int], *, seed: int, epoch: int, drop_last: bool, shuffle: bool, segment: int = 0
    ) -> list[list[int]]:
        """Return what every rank yields when ``pool`` is dealt, by shard and then local rank.

        A shard's order is computed once and dealt strided to its ranks (local rank ``l`` takes positions
        ``l, l + P, ...``), as :func:`~ignite_ext.data.sampler.indices.node_shard_indices` does.

        Args:
            pool: the indices to deal, in contiguous blocks (a fresh epoch's
                :func:`~ignite_ext.data.sampler.mixing.epoch_pool`, or the rest of an epoch, ascending).
            seed: base seed.
            epoch: epoch number.
            drop_last: every rank yields ``floor(len(pool) / R)`` instead of ``ceil``.
            shuffle: shuffle within shards.
            segment: which world of the epoch deals ``pool`` (0: the world the epoch started on).

        Returns:
            ``num_replicas`` lists of equal length.
        """
        nproc = self.nproc_per_node
        length = nproc * self.length(len(pool), drop_last)
        out: list[list[int]] = []
        for shard in range(self.shards):
            order = pool_order(pool, self.shards, shard, length, seed, epoch, shuffle, segment)
            out += [order[local::nproc] for local in range(nproc)]
        return out

    def as_state(self) -> dict[str, Any]:
        """The layout as plain values: ``num_replicas``, ``shard_by`` and ``num_shards``."""
        return {"num_replicas": self.num_replicas, "shard_by": self.shard_by, "num_shards": self.shards}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], default: Layout) -> Layout:
        """Read :meth:`as_state`'s keys from ``state``; a missing key keeps ``default``'s value.

        Raises:
            ValueError: the values do not describe a world.
            TypeError: a count is not an int.
        """
        shard_by = state.get("shard_by", default.shard_by)
        replicas = state.get("num_replicas", default.num_replicas)
        shards = state.get("num_shards")
        if shards is None and shard_by == "node":
            if (shard_by, replicas) != (default.shard_by, default.num_replicas):
                raise ValueError(f"a state of shard_by='node' on {replicas} ranks needs num_shards (its nodes)")
            shards = default.shards
        return cls(replicas, shard_by, shards)


class Placement(NamedTuple):
    """Where one rank sits in a :class:`Layout`: its rank, shard, and local rank within the shard."""

    layout: Layout
    rank: int
    shard: int
    local: int
    nnodes: int | None
    node_rank: int | None
    nproc_per_node: int | None
    local_rank: int | None


def resolve_placement(
    num_replicas: int | None,
    rank: int | None,
    shard_by: str,
    nnodes: int | None,
    node_rank: int | None,
    nproc_per_node: int | None,
    local_rank: int | None,
) -> Placement:
    """Resolve :class:`~ignite_ext.data.ShardedDistributedSampler`'s arguments, with defaults from ``idist``.

    ``num_replicas`` and ``rank`` default to ``idist.get_world_size()`` and ``idist.get_rank()``. With
    ``shard_by="node"`` the node layout comes from ``nnodes`` / ``nproc_per_node`` when given, else from
    ``idist`` (only for the world this process is in); ``node_rank`` and ``local_rank`` default to
    ``rank // nproc_per_node`` and ``rank % nproc_per_node`` with an explicit ``rank``, else to ``idist``'s.

    Raises:
        ValueError: an argument is out of range or inconsistent.
        TypeError: an argument has the wrong type.

    Examples:
        >>> from ignite_ext.data.sampler.layout import resolve_placement
        >>> resolve_placement(6, 4, "node", None, None, 2, None)[1:4]
        (4, 2, 0)

    .. versionadded:: 0.2.0
    """
    if shard_by not in SHARD_BY:
        raise ValueError(f"shard_by must be one of {list(SHARD_BY)}, got {shard_by!r}")
    replicas = check_int("num_replicas", idist.get_world_size() if num_replicas is None else num_replicas, 1)
    this_rank = check_index("rank", idist.get_rank() if rank is None else rank, "num_replicas", replicas)
    if shard_by == "rank":
        node_args = {
            "nnodes": nnodes,
            "node_rank": node_rank,
            "nproc_per_node": nproc_per_node,
            "local_rank": local_rank,
        }
        given = [name for name, value in node_args.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to shard_by='node'")
        return Placement(Layout(replicas), this_rank, this_rank, 0, None, None, None, None)

    if nproc_per_node is None:
        if nnodes is not None:
            nnodes = check_int("nnodes", nnodes, 1)
            if replicas % nnodes:
                raise ValueError(f"num_replicas={replicas} is not a multiple of nnodes={nnodes}")
            nproc_per_node = replicas // nnodes
        elif replicas == idist.get_world_size():
            nproc_per_node = idist.get_nproc_per_node()
        else:
            # Guessing a node layout for a world that is not this one would silently pick the wrong shards.
            raise ValueError(
                f"shard_by='node' with num_replicas={replicas} (the world size is {idist.get_world_size()}) "
                "needs nnodes or nproc_per_node"
            )
    nproc_per_node = check_int("nproc_per_node", nproc_per_node, 1)
    if nnodes is None:
        nnodes = replicas // nproc_per_node if num_replicas is not None else idist.get_nnodes()
    nnodes = check_int("nnodes", nnodes, 1)
    if nnodes * nproc_per_node != replicas:
        raise ValueError(
            f"shard_by='node' needs the same number of processes on every node: nnodes={nnodes} x "
            f"nproc_per_node={nproc_per_node} != num_replicas={replicas} (pass nnodes / nproc_per_node "
            "explicitly when num_replicas is given)"
        )
    if node_rank is None:
        node_rank = this_rank // nproc_per_node if rank is not None else idist.get_node_rank()
    if local_rank is None:
        local_rank = this_rank % nproc_per_node if rank is not None else idist.get_local_rank()
    node_rank = check_index("node_rank", node_rank, "nnodes", nnodes)
    local_rank = check_index("local_rank", local_rank, "nproc_per_node", nproc_per_node)
    layout = Layout(replicas, "node", nnodes)
    return Placement(layout, this_rank, node_rank, local_rank, nnodes, node_rank, nproc_per_node, local_rank)
