"""A distributed sampler whose shards stay put across epochs, so per-rank (or per-node) caches keep hitting.

:class:`torch.utils.data.DistributedSampler` reshuffles the whole dataset every epoch and deals it out again, so
each rank sees a new quarter of the data each epoch (with 4 ranks) and a per-rank cache of decoded samples hits
only ~0/25/44/58% in epochs 0-3 while growing toward the whole dataset. :class:`ShardedDistributedSampler`
gives every rank one contiguous, balanced shard for the whole run and only shuffles the order *within* it, so
from epoch 1 on a per-rank cache hits 100% and holds ``N / R`` samples.

The index maths lives in pure functions (``indices``, ``restripe``), the arguments' defaults in ``layout`` and the
saved state's format in ``resume``; this class only ties them to an iteration.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any, Literal, cast

from torch.utils.data import Dataset, DistributedSampler

import ignite_ext.distributed as idist
from ignite_ext.data.fork_safety import warn_if_forks_can_hang
from ignite_ext.data.sampler.indices import check_int, samples_per_replica
from ignite_ext.data.sampler.layout import resolve_placement
from ignite_ext.data.sampler.mixing import check_mix, epoch_pool, mixed_shards
from ignite_ext.data.sampler.restripe import Segment
from ignite_ext.data.sampler.resume import Config, Position, read_state, resumed_order, same_everywhere, write_state

__all__ = ["ShardedDistributedSampler"]


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
    ``state_dict(consumed=...)`` (with ignite, :class:`~ignite_ext.data.sampler.SamplerHandler` does it). Ranks
    train in lockstep, so rank 0's copy of the state can be loaded by every rank, also of a world of another
    size: the rest of the epoch is then restriped over it (:meth:`load_state_dict`).

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
        mix: the fraction of every shard exchanged with the other shards each epoch, in ``[0, 1]``; ``0`` (the
            default) keeps the shards fixed. Each epoch about ``mix`` of a shard's samples move to other shards
            and as many arrive, drawn from ``(seed, epoch)`` alike on every rank, so a shard's content is renewed
            over about ``1 / mix`` epochs while a cache keeps hitting on the rest; every epoch still covers the
            dataset once, each shard keeps its size, and the rank's order is a permutation of its shard
            (:mod:`~ignite_ext.data.sampler.mixing`). When ``dataset`` is a
            :class:`~ignite_ext.data.CachedDataset`, its cache follows the shards: as each epoch's iteration
            starts, it is told what its readers read
            (:meth:`CachedDataset.follow <ignite_ext.data.CachedDataset.follow>`), evicts what left and stores
            what arrived in the freed space.
        load_ahead: with ``mix > 0`` over a :class:`~ignite_ext.data.CachedDataset`, also have the cache load the
            samples that arrive next epoch during this one, in a low-priority process of its own (see
            :meth:`CachedDataset.follow <ignite_ext.data.CachedDataset.follow>`), so that they are hits too; the
            cache then holds ``f`` of a shard more. Default False.

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
    .. versionchanged:: 0.2.0
        A state saved on another world size continues its epoch (restriped) instead of restarting it.
    .. versionchanged:: 0.4.0
        ``mix``: shards that exchange a fraction of their samples each epoch, followed by a cache over them;
        ``load_ahead``.
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
        mix: float = 0.0,
        load_ahead: bool = False,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"dataset must have a length (a map-style dataset), got {type(dataset).__name__}")
        place = resolve_placement(num_replicas, rank, shard_by, nnodes, node_rank, nproc_per_node, local_rank)
        seed = check_int("seed", seed)
        mix = check_mix(mix)
        if not isinstance(load_ahead, bool):
            raise TypeError(f"load_ahead must be True or False, got {load_ahead!r}")
        warn_if_forks_can_hang("ShardedDistributedSampler")
        # Explicit values: torch's constructor would otherwise ask torch.distributed, which is not initialised
        # under Horovod, XLA or in serial mode.
        super().__init__(
            cast(Dataset[Any], dataset),
            num_replicas=place.layout.num_replicas,
            rank=place.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.shard_by: Literal["rank", "node"] = shard_by
        self.mix = mix
        self.load_ahead = load_ahead
        self.layout = place.layout
        self.nnodes: int | None = place.nnodes
        self.node_rank: int | None = place.node_rank
        self.nproc_per_node: int | None = place.nproc_per_node
        self.local_rank: int | None = place.local_rank
        self.num_shards: int = place.layout.shards
        self.shard: int = place.shard
        self._local = place.local
        self._dataset_len = len(dataset)
        self.num_samples = samples_per_replica(self._dataset_len, self.num_replicas, drop_last)
        self.total_size = self.num_samples * self.num_replicas
        # Where the next iteration starts (set by load_state_dict), how far the current one got, and the
        # training loop's own count when it reports one.
        self._start = 0
        self._yielded = 0
        self._consumed: int | None = None
        self._iteration = 0
        # The current pass's epoch, when it was restriped after a change of world size: the epoch's earlier
        # worlds, and this rank's order for the rest of the epoch. Both hold for one pass only.
        self._history: tuple[Segment, ...] = ()
        self._order: list[int] | None = None
        self._pending = False  # the next iteration continues a loaded position
        self._followed: int | None = None  # the epoch the dataset's cache was last told of

    def _cache_shards(self, scope: object) -> list[int] | None:
        """The shards whose samples a cache of ``scope`` over this sampler's dataset serves; None if unknown."""
        if scope != "node" or self.shard_by == "node":
            return [self.shard]  # a rank's cache serves its shard (shard_by="node": its node's, read in parts)
        # A node cache of shards by rank serves the node's ranks: known where ranks are numbered node by node.
        world, rank = idist.get_world_size(), idist.get_rank()
        nproc, node = idist.get_nproc_per_node(), idist.get_node_rank()
        if self.num_replicas != world or rank != self.rank or rank != node * nproc + idist.get_local_rank():
            return None
        return list(range(node * nproc, (node + 1) * nproc))

    def _follow(self) -> None:
        """Tell the dataset's cache what its readers read this epoch (only with ``mix > 0``).

        So that it evicts what left and stores what arrived (:meth:`CachedDataset.follow
        <ignite_ext.data.CachedDataset.follow>`). Not in an epoch restriped over another world (its ranks read
        outside their shards): the cache keeps everything then, until the next epoch.
        """
        follow = getattr(self.dataset, "follow", None)
        if self.mix == 0.0 or not callable(follow) or self._history or self._followed == self.epoch:
            return
        self._followed = self.epoch
        shards = self._cache_shards(getattr(self.dataset, "scope", "rank"))
        if shards is None:
            return
        pool = mixed_shards(self._dataset_len, self.num_shards, self.seed, self.epoch, self.mix)
        keep = [index for shard in shards for index in pool[shard]]
        if not self.load_ahead:
            follow(keep)
            return
        upcoming = mixed_shards(self._dataset_len, self.num_shards, self.seed, self.epoch + 1, self.mix)
        here = set(keep)
        follow(keep, ahead=[index for shard in shards for index in upcoming[shard] if index not in here])

    def indices(self, epoch: int | None = None) -> list[int]:
        """Return this rank's indices for a whole epoch on its fixed shard, without changing the sampler's state.

        After :meth:`load_state_dict`, the next iteration yields :meth:`remaining_indices` instead.

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
        epoch = check_int("epoch", self.epoch if epoch is None else epoch)
        return self.layout.order(
            epoch_pool(self._dataset_len, self.num_shards, self.seed, epoch, self.mix),
            self.shard,
            self._local,
            seed=self.seed,
            epoch=epoch,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
        )

    def remaining_indices(self) -> list[int]:
        """Return the indices the next iteration will yield, without changing the sampler's state.

        That is the whole epoch (:meth:`indices`), except right after :meth:`load_state_dict`: then the rest of
        the loaded position, and, when the state was saved on another world, this rank's share of the rest of
        the epoch restriped over the new world (no more than ``len(self)``, the same number on every rank).

        Examples:
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> sampler = ShardedDistributedSampler(range(8), num_replicas=2, rank=0, shuffle=False)
            >>> sampler.load_state_dict({"epoch": 0, "consumed": 3})
            >>> sampler.remaining_indices()
            [3]

        .. versionadded:: 0.2.0
        """
        if not self._pending:
            return self.indices()
        return self._pass_order()[self._start :]

    def _pass_order(self) -> list[int]:
        return self._order if self._order is not None else self.indices()

    def _pass_length(self) -> int:
        return len(self._order) if self._order is not None else self.num_samples

    def __iter__(self) -> Iterator[int]:
        # Computed here, not lazily, so the epoch and start position are those at iter() time, as with torch.
        if not self._pending:
            # A new pass over the epoch: a loaded position and a restriped order only hold for the first one.
            self._history, self._order, self._start = (), None, 0
        self._pending = False
        self._follow()
        order = self._pass_order()
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
            self._history, self._order, self._pending = (), None, False

    def set_consumed(self, consumed: int) -> None:
        """Record how many of this epoch's indices the training loop has consumed, for :meth:`state_dict`.

        Needed when the DataLoader has workers: they prefetch, so the sampler has handed out more indices than
        the loop has trained on. With ignite, :class:`~ignite_ext.data.sampler.SamplerHandler` calls it with the
        batches the loop took. The value holds until the next iteration or epoch starts.

        Args:
            consumed: indices consumed so far in this pass's order (:meth:`indices`, or after a load the order
                :meth:`remaining_indices` is the tail of); values above its length (a short last batch counted
                as full) are capped.

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
        self._consumed = min(check_int("consumed", consumed, 0), self._pass_length())

    def _config(self) -> Config:
        return Config(self._dataset_len, self.seed, self.shuffle, self.drop_last, self.mix)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Return the position in the current epoch, to be restored with :meth:`load_state_dict`.

        Args:
            consumed: indices of this pass the training loop has consumed; default the value given to
                :meth:`set_consumed`, else the number of indices handed out by the current iteration (exact
                with ``num_workers=0``). Capped at the pass's length.

        Returns:
            ``{"epoch", "consumed"}``, the layout the position refers to (``dataset_len``, ``num_replicas``,
            ``shard_by``, ``num_shards``, ``seed``, ``shuffle``, ``drop_last``, ``mix``) and the epoch's
            ``history``: the earlier worlds it ran on, each with its layout and ``consumed`` (empty unless the world
            changed during the epoch). Plain Python values, the same on every rank; see
            :mod:`ignite_ext.data.sampler.resume`.

        Raises:
            ValueError: ``consumed`` is negative.

        Examples:
            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> sampler = ShardedDistributedSampler(range(10), num_replicas=2, rank=0)
            >>> sampler.set_epoch(3)
            >>> state = sampler.state_dict(consumed=4)
            >>> state["epoch"], state["consumed"], state["num_replicas"], state["history"]
            (3, 4, 2, [])

        .. versionadded:: 0.1.0
        .. versionchanged:: 0.2.0
            The ``history`` key.
        """
        if consumed is None:
            consumed = self._consumed if self._consumed is not None else self._yielded
        consumed = min(check_int("consumed", consumed, 0), self._pass_length())
        return write_state(self._config(), self.layout, Position(self.epoch, self._history, consumed))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`, on this world or another; the next iteration continues.

        On the world the state was saved on, the next iteration yields the rest of this rank's order. On another
        world, the indices no old rank consumed are restriped over this one
        (:func:`~ignite_ext.data.sampler.restripe.restripe`), an equal share per rank, so that over the epoch
        every sample is yielded once up to the padding (``drop_last=False``: at most ``R - 1`` repeats per world
        the epoch ran on) or the trim (``drop_last=True``: at most ``R - 1`` left out). Later epochs use this
        world's fixed shards.

        When the sampler spans the world (``num_replicas == idist.get_world_size() > 1``) this is a collective
        (:func:`~ignite_ext.distributed.agree`): every rank calls it, and a bad state, states that differ between
        ranks or datasets of different lengths raise the same ``ValueError`` on every rank. Cost: one exchange
        of a few bytes per rank; on another world also O(N) time and memory, to replay what was consumed.

        Args:
            state_dict: a mapping with at least ``epoch`` and ``consumed``; the other keys of :meth:`state_dict`
                are optional (missing ones are taken to match this sampler).

        Raises:
            ValueError: a key is missing or malformed; ``consumed`` is more than the saved world's ranks yield;
                the state was saved with another ``dataset_len``, ``seed``, ``shuffle``, ``drop_last`` or ``mix``; the
                ranks loaded different states.
            TypeError: ``epoch`` or ``consumed`` is not an int.

        Examples:
            4 ranks consumed 2 indices each, then 2 ranks share the other 4:

            >>> from ignite_ext.data import ShardedDistributedSampler
            >>> old = [ShardedDistributedSampler(range(12), num_replicas=4, rank=r) for r in range(4)]
            >>> head = [i for s in old for i in s.indices()[:2]]
            >>> new = [ShardedDistributedSampler(range(12), num_replicas=2, rank=r) for r in range(2)]
            >>> for s in new:
            ...     s.load_state_dict(old[0].state_dict(consumed=2))
            >>> [len(s.remaining_indices()) for s in new], new[0].state_dict()["history"]
            ([2, 2], [{'num_replicas': 4, 'shard_by': 'rank', 'num_shards': 4, 'consumed': 2}])
            >>> sorted(head + [i for s in new for i in s]) == list(range(12))
            True

        .. versionadded:: 0.1.0
        .. versionchanged:: 0.2.0
            Another world size continues the epoch, restriped; another dataset length, seed, ``shuffle`` or
            ``drop_last`` raises (it used to warn and restart the epoch).
        """
        config, layout, loaded = self._config(), self.layout, []

        def load() -> str:
            position = read_state(state_dict, config, layout)
            loaded.append((position, resumed_order(config, layout, self.shard, self._local, position)))
            return f"{position.describe()}; {config}; {layout}"

        if self.num_replicas == idist.get_world_size() > 1:
            idist.agree(load, "loading the ShardedDistributedSampler state", check=same_everywhere)
        else:
            load()
        position, order = loaded[0]
        self.epoch = position.epoch
        self._history, self._order = position.history, order
        self._start = self._yielded = position.consumed
        self._consumed = None
        self._pending = True
