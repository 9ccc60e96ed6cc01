"""A distributed sampler whose shards stay put across epochs, so per-rank (or per-node) caches keep hitting.

:class:`torch.utils.data.DistributedSampler` reshuffles the whole dataset every epoch and deals it out again, so
each rank sees a new quarter of the data each epoch (with 4 ranks) and a per-rank cache of decoded samples hits
only ~0/25/44/58% in epochs 0-3 while growing toward the whole dataset. :class:`ShardedDistributedSampler`
gives every rank one contiguous, balanced shard for the whole run and only shuffles the order *within* it, so
from epoch 1 on a per-rank cache hits 100% and holds ``N / R`` samples.

The index maths lives in pure functions of ``(n, num_shards, shard, seed, epoch, drop_last, shuffle)``
(:func:`shard_bounds`, :func:`samples_per_replica`, :func:`shard_indices`, :func:`node_shard_indices`), so it
can be checked without processes; the sampler only adds arguments, defaults from :mod:`ignite_ext.distributed`
and resumable state.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Literal, cast

from torch.utils.data import Dataset, DistributedSampler

import ignite_ext.distributed as idist
from ignite_ext.data.sampler.indices import (
    check_index,
    check_int,
    node_shard_indices,
    samples_per_replica,
    shard_indices,
)

__all__ = ["ShardedDistributedSampler"]

_SHARD_BY: tuple[str, ...] = ("rank", "node")
# A saved position names the same samples only if all of these match; otherwise its epoch restarts.
_LAYOUT_KEYS = ("dataset_len", "num_replicas", "shard_by", "num_shards", "seed", "shuffle", "drop_last")


class ShardedDistributedSampler(DistributedSampler[int]):
    """A :class:`~torch.utils.data.DistributedSampler` that keeps each rank's (or node's) shard fixed across epochs.

    Every rank owns one contiguous block of the dataset (sizes differ by at most one) for the whole run and
    yields it in a new order each epoch, so whatever a rank caches stays useful. Guarantees:

    * every rank yields exactly ``len(sampler)`` indices per epoch: ``ceil(N / R)``, or ``floor(N / R)`` with
      ``drop_last`` (the same as torch's sampler);
    * ``drop_last=False``: every index appears in every epoch and no index is yielded by two ranks, except that
      a shard one short repeats one of its *own* samples (a different one each epoch);
    * ``drop_last=True``: a shard one over leaves out one of its own samples, a different one each epoch, so
      every sample is seen across epochs;
    * the order depends only on ``(seed, epoch, shard)``, never on a global RNG or on creation order;
    * ``N < R`` with ``drop_last=False``: ranks past the ``N``-th have no samples of their own and repeat sample
      ``rank % N`` (each rank still yields one index per epoch, as with torch's sampler); with ``drop_last=True``
      every rank yields nothing, again as with torch's sampler.

    ``shard_by="node"`` gives the shards to nodes instead (``idist.get_nnodes()`` of them): a node's processes
    share its shard, shuffled together each epoch and dealt out strided by local rank (see
    :func:`node_shard_indices`). Use it with a node-local cache.

    Because it is a ``DistributedSampler``, ``idist.auto_dataloader(dataset, sampler=sampler)`` uses it as is,
    and ignite's ``setup_common_training_handlers(train_sampler=sampler)`` calls :meth:`set_epoch`.

    :meth:`state_dict` / :meth:`load_state_dict` resume exactly in the middle of an epoch: the state holds the
    epoch and how many of this epoch's indices were consumed. By default that is the number of indices handed to
    the DataLoader, which equals what the training loop consumed only with ``num_workers=0``; with workers the
    DataLoader runs ahead, so report the loop's own count with :meth:`set_consumed` or
    ``state_dict(consumed=...)``. Ranks train in lockstep, so the state is the same on every rank and the one
    saved by rank 0 can be loaded everywhere. A state saved with another world size, dataset size, seed or
    sharding restarts its epoch on the new shards, with a warning.

    Args:
        dataset: a map-style dataset with ``__len__`` (assumed not to change size).
        num_replicas: number of ranks; default ``idist.get_world_size()`` (works under every ``idist`` backend,
            Horovod and XLA included, and in serial mode).
        rank: this rank; default ``idist.get_rank()``.
        shuffle: shuffle the order within each shard every epoch.
        seed: base seed; must be the same on every rank.
        drop_last: yield ``floor(N / R)`` per rank instead of ``ceil(N / R)``.
        shard_by: ``"rank"`` (one shard per rank) or ``"node"`` (one shard per node).
        nnodes: number of nodes (``shard_by="node"`` only); default ``num_replicas // nproc_per_node`` when
            ``num_replicas`` is given, else ``idist.get_nnodes()``. When ``num_replicas`` differs from the world
            size, ``nnodes`` or ``nproc_per_node`` must be given.
        node_rank: this node; default ``rank // nproc_per_node`` when ``rank`` is given, else
            ``idist.get_node_rank()``.
        nproc_per_node: processes per node (the same on every node); default ``num_replicas // nnodes`` when
            ``nnodes`` is given, else ``idist.get_nproc_per_node()``.
        local_rank: this process on its node; default ``rank % nproc_per_node`` when ``rank`` is given, else
            ``idist.get_local_rank()``.

    Attributes:
        num_shards: how many shards the dataset is cut into: ``num_replicas``, or ``nnodes`` with
            ``shard_by="node"``.
        shard: the shard this process reads: ``rank``, or ``node_rank`` with ``shard_by="node"``.
        nnodes: the node layout with ``shard_by="node"`` (``nnodes``, ``node_rank``, ``nproc_per_node`` and
            ``local_rank``); all four are ``None`` with ``shard_by="rank"``.

    Raises:
        TypeError: ``dataset`` has no length, or an argument has the wrong type.
        ValueError: an argument is out of range or inconsistent (e.g. ``rank >= num_replicas``, an unknown
            ``shard_by``, ``nnodes * nproc_per_node != num_replicas``).

    Examples:
        >>> from ignite_ext.data import ShardedDistributedSampler
        >>> samplers = [ShardedDistributedSampler(range(10), num_replicas=3, rank=r) for r in range(3)]
        >>> [len(s) for s in samplers]
        [4, 4, 4]
        >>> [sorted(set(s)) for s in samplers]
        [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
        >>> sampler = ShardedDistributedSampler(range(100), num_replicas=4, rank=1)
        >>> first = list(sampler)
        >>> sampler.set_epoch(1)
        >>> second = list(sampler)
        >>> sorted(first) == sorted(second) == list(range(25, 50)), first != second
        (True, True)

        Resuming in the middle of an epoch:

        >>> sampler = ShardedDistributedSampler(range(10), num_replicas=3, rank=1, seed=7)
        >>> it = iter(sampler)
        >>> seen = [next(it), next(it)]
        >>> state = sampler.state_dict()
        >>> state["epoch"], state["consumed"]
        (0, 2)
        >>> resumed = ShardedDistributedSampler(range(10), num_replicas=3, rank=1, seed=7)
        >>> resumed.load_state_dict(state)
        >>> seen + list(resumed) == list(ShardedDistributedSampler(range(10), num_replicas=3, rank=1, seed=7))
        True

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        shard_by: Literal["rank", "node"] = "rank",
        *,
        nnodes: int | None = None,
        node_rank: int | None = None,
        nproc_per_node: int | None = None,
        local_rank: int | None = None,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"dataset must have a length (a map-style dataset), got {type(dataset).__name__}")
        if shard_by not in _SHARD_BY:
            raise ValueError(f"shard_by must be one of {list(_SHARD_BY)}, got {shard_by!r}")
        replicas = check_int("num_replicas", idist.get_world_size() if num_replicas is None else num_replicas, 1)
        this_rank = check_index("rank", idist.get_rank() if rank is None else rank, "num_replicas", replicas)
        seed = check_int("seed", seed)

        if shard_by == "node":
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
        else:
            node_args = {
                "nnodes": nnodes,
                "node_rank": node_rank,
                "nproc_per_node": nproc_per_node,
                "local_rank": local_rank,
            }
            given = [name for name, value in node_args.items() if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to shard_by='node'")

        # Explicit values: torch's constructor would otherwise ask torch.distributed, which is not initialised
        # under Horovod, XLA or in serial mode.
        super().__init__(
            cast(Dataset[Any], dataset),
            num_replicas=replicas,
            rank=this_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.shard_by: Literal["rank", "node"] = shard_by
        self.nnodes: int | None = nnodes
        self.node_rank: int | None = node_rank
        self.nproc_per_node: int | None = nproc_per_node
        self.local_rank: int | None = local_rank
        self.num_shards: int = replicas if nnodes is None else nnodes
        self.shard: int = this_rank if node_rank is None else node_rank
        self._dataset_len = len(dataset)
        self.num_samples = samples_per_replica(self._dataset_len, replicas, drop_last)
        self.total_size = self.num_samples * replicas
        # Where the next iteration starts (set by load_state_dict), how far the current one got, and the
        # training loop's own count when it reports one.
        self._start = 0
        self._yielded = 0
        self._consumed: int | None = None
        self._iteration = 0

    def indices(self, epoch: int | None = None) -> list[int]:
        """Return this rank's indices for a whole epoch, in order, without changing the sampler's state.

        Args:
            epoch: the epoch; default the current one (:meth:`set_epoch`).

        Returns:
            ``len(self)`` dataset indices.

        Examples:
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> sampler = ShardedDistributedSampler(range(8), num_replicas=2, rank=1, shuffle=False)
            >>> sampler.indices()
            [4, 5, 6, 7]

        .. versionadded:: 0.1.0
        """
        epoch = self.epoch if epoch is None else epoch
        if self.nproc_per_node is not None and self.local_rank is not None:
            return node_shard_indices(
                self._dataset_len,
                self.num_shards,
                self.shard,
                self.nproc_per_node,
                self.local_rank,
                seed=self.seed,
                epoch=epoch,
                drop_last=self.drop_last,
                shuffle=self.shuffle,
            )
        return shard_indices(
            self._dataset_len,
            self.num_replicas,
            self.rank,
            seed=self.seed,
            epoch=epoch,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
        )

    def __iter__(self) -> Iterator[int]:
        # Computed here, not lazily, so the epoch and start position are those at iter() time, as with torch.
        order = self.indices()
        start, self._start = self._start, 0
        self._yielded, self._consumed = start, None
        self._iteration += 1
        return self._count(order, start, self._iteration)

    def _count(self, order: list[int], start: int, iteration: int) -> Iterator[int]:
        for idx in order[start:]:
            # An abandoned earlier iterator must not move the count of the current one.
            if iteration == self._iteration:
                self._yielded += 1
            yield idx

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration; a new epoch starts from its beginning.

        Setting the epoch the sampler already has keeps a position restored by :meth:`load_state_dict`, so an
        ``EPOCH_STARTED`` handler that calls ``set_epoch(engine.state.epoch - 1)`` does not undo a resume.

        Args:
            epoch: epoch number; the same on every rank.

        Examples:
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> sampler = ShardedDistributedSampler(range(6), num_replicas=2, rank=0)
            >>> a = list(sampler)
            >>> sampler.set_epoch(1)
            >>> b = list(sampler)
            >>> sorted(a) == sorted(b) == [0, 1, 2]
            True

        .. versionadded:: 0.1.0
        """
        epoch = check_int("epoch", epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = self._yielded = 0
            self._consumed = None

    def set_consumed(self, consumed: int) -> None:
        """Record how many of this epoch's indices the training loop has consumed, for :meth:`state_dict`.

        Needed when the DataLoader has workers: they prefetch, so the sampler has handed out more indices than
        the loop has trained on. With ignite, at ``ITERATION_COMPLETED``:
        ``sampler.set_consumed((engine.state.iteration - (engine.state.epoch - 1) * engine.state.epoch_length)
        * batch_size)``. The value holds until the next iteration or epoch starts.

        Args:
            consumed: indices consumed so far in this epoch; values above ``len(self)`` (a short last batch
                counted as full) are capped at ``len(self)``.

        Raises:
            ValueError: ``consumed`` is negative.

        Examples:
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> sampler = ShardedDistributedSampler(range(100), num_replicas=4, rank=0)
            >>> it = iter(sampler)
            >>> prefetched = [next(it) for _ in range(20)]
            >>> sampler.set_consumed(8)
            >>> sampler.state_dict()["consumed"]
            8

        .. versionadded:: 0.1.0
        """
        self._consumed = min(check_int("consumed", consumed, 0), self.num_samples)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Return the position in the current epoch, to be restored with :meth:`load_state_dict`.

        Args:
            consumed: indices of this epoch the training loop has consumed; default the value given to
                :meth:`set_consumed`, else the number of indices handed out by the current iteration (exact
                with ``num_workers=0``). Capped at ``len(self)``.

        Returns:
            ``{"epoch", "consumed"}`` plus the layout the position refers to (``dataset_len``,
            ``num_replicas``, ``shard_by``, ``num_shards``, ``seed``, ``shuffle``, ``drop_last``). Plain Python
            values, the same on every rank.

        Raises:
            ValueError: ``consumed`` is negative.

        Examples:
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> sampler = ShardedDistributedSampler(range(10), num_replicas=2, rank=0)
            >>> sampler.set_epoch(3)
            >>> state = sampler.state_dict(consumed=4)
            >>> state["epoch"], state["consumed"], state["num_replicas"]
            (3, 4, 2)

        .. versionadded:: 0.1.0
        """
        if consumed is None:
            consumed = self._consumed if self._consumed is not None else self._yielded
        consumed = min(check_int("consumed", consumed, 0), self.num_samples)
        return {
            "epoch": self.epoch,
            "consumed": consumed,
            "dataset_len": self._dataset_len,
            "num_replicas": self.num_replicas,
            "shard_by": self.shard_by,
            "num_shards": self.num_shards,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; the next iteration continues from it.

        If the state was saved with a different layout (world size, dataset size, seed, shuffle, drop_last or
        sharding), its position means other samples now: the sampler warns and restarts that epoch from its
        beginning on the new shards. Keys other than ``epoch`` and ``consumed`` are optional.

        Args:
            state_dict: a mapping with at least ``epoch`` and ``consumed``.

        Raises:
            ValueError: a key is missing, or ``consumed`` is outside ``[0, len(self)]`` for the same layout.
            TypeError: ``epoch`` or ``consumed`` is not an int.

        Examples:
            >>> import warnings
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> old = ShardedDistributedSampler(range(12), num_replicas=4, rank=0)
            >>> new = ShardedDistributedSampler(range(12), num_replicas=2, rank=0)
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     warnings.simplefilter("always")
            ...     new.load_state_dict(old.state_dict(consumed=2))
            >>> len(caught), new.state_dict()["consumed"]
            (1, 0)

        .. versionadded:: 0.1.0
        """
        missing = [key for key in ("epoch", "consumed") if key not in state_dict]
        if missing:
            raise ValueError(f"not a ShardedDistributedSampler state: missing {missing}")
        epoch = check_int("epoch", state_dict["epoch"])
        consumed = check_int("consumed", state_dict["consumed"], 0)
        mine = self.state_dict(consumed=0)
        changed = [key for key in _LAYOUT_KEYS if key in state_dict and state_dict[key] != mine[key]]
        if changed:
            details = ", ".join(f"{key}: {state_dict[key]!r} -> {mine[key]!r}" for key in changed)
            warnings.warn(
                f"sampler state was saved with a different layout ({details}); restarting epoch {epoch} "
                "from its beginning on the new shards",
                stacklevel=2,
            )
            consumed = 0
        elif consumed > self.num_samples:
            raise ValueError(f"consumed={consumed} is more than the {self.num_samples} indices of an epoch")
        self.epoch = epoch
        self._start = self._yielded = consumed
        self._consumed = None
