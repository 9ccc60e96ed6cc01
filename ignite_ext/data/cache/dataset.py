"""A shared in-memory sample cache for map-style datasets: load once, then serve every worker and rank from RAM.

:class:`CachedDataset` wraps any map-style dataset. The first read of an index loads it from the wrapped dataset and
stores it, serialised compactly, in a shared-memory arena (:mod:`ignite_ext.data.cache.arena`), or, once that is
full, in the optional disk tier (:mod:`ignite_ext.data.cache.tiers`); every later read of that index by any
DataLoader worker of the rank (``scope="rank"``) or by any rank of the node (``scope="node"``) is served from there:
small tensors and arrays are copied out, large ones lent as private copy-on-write views
(:mod:`ignite_ext.data.cache._cow`). See the cache guide for the guarantees, the memory model and the sampler pairings.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

from torch.utils.data import Dataset, get_worker_info

from ignite_ext.data.cache import _mapping, _orphans
from ignite_ext.data.cache._ahead import LoadingAhead
from ignite_ext.data.cache._fork_memory import share_inherited_heap
from ignite_ext.data.cache._world import ignite_world
from ignite_ext.data.cache.codec import decode, encode
from ignite_ext.data.cache.identity import checked_name, construction_site, sample_fingerprint
from ignite_ext.data.cache.stats import CacheStats
from ignite_ext.data.cache.tiers import checker, create_tiers, disk_option, node_tiers
from ignite_ext.data.cache.transforms import FrozenTransformWarning, warn_if_frozen
from ignite_ext.data.fork_safety import warn_if_forks_can_hang

# ignite and ignite_ext.distributed are imported only where a rank's main process needs them (construction and
# stats in a distributed job): a process alone, and a DataLoader worker that unpickles the dataset (spawn), load
# neither, and workers forked from a process alone do not pay for them (see ._world).

# CacheStats (defined in .stats) and the warning re-exported: users meet them here.
__all__ = ["CacheStats", "CachedDataset", "FrozenTransformWarning"]

Scope = Literal["rank", "node"]
Reduce = Literal["rank", "node", "world"]
_SCOPES = ("rank", "node")
_REDUCTIONS = ("rank", "node", "world")


class _MapStyle(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


class CachedDataset(Dataset[Any]):
    """Serve the samples of ``dataset`` from a shared-memory cache after their first load.

    The cache is created in the constructing process (a rank's main process) and reaches DataLoader workers by
    pickling (of the cache, only its shared-memory name travels; workers map it on first use), so it works with the
    ``fork`` and ``spawn`` start methods and with or without ``persistent_workers``. Samples are stored as a small
    header plus the raw bytes of their tensors and arrays. Every read returns tensors and arrays of its own (copies
    under 128 KiB, private copy-on-write views of the cache from 128 KiB up, which cost no copy unless written to):
    modifying a sample never changes the cache, nor what a later read gets. Nothing is evicted: once the cache is
    full, samples not in it are loaded from ``dataset`` each time they are read (and counted as misses). The one
    exception is asked for: a cache told what its readers will read (:meth:`follow`, which a
    :class:`~ignite_ext.data.ShardedDistributedSampler` with ``mix > 0`` calls each epoch) evicts the rest and
    reuses its space; its reads are then copies, large ones included.

    With ``disk_dir``, what does not fit ``capacity_bytes`` goes to a second tier: one file in that node-local
    directory, of the same layout and with the same guarantees as the RAM one, shared the same way (by the rank's
    workers, or by the node's ranks), so that a dataset larger than RAM is still loaded once. Reads look in RAM,
    then on disk; each sample is stored in the first tier with room for it (see
    :mod:`~ignite_ext.data.cache.tiers`).

    Args:
        dataset: a map-style dataset (``len()`` and integer indexing).
        scope: ``"rank"``: one cache per process that constructs a ``CachedDataset``, shared by its DataLoader
            workers. ``"node"``: one cache per node, shared by all ranks of the node; then every rank must
            construct it (collectively, through :mod:`ignite.distributed`), over the same dataset, and the
            node's local rank 0 creates it (with its own ``capacity_bytes``).
        capacity_bytes: bytes of sample data the cache may hold. ``None``: half of the free space of
            ``/dev/shm`` at construction, less what this user's live caches may still claim; with
            ``scope="rank"`` in a distributed job, that half is split evenly between the ranks of the node.
        transform: applied to every sample read, after the cache, in the process that reads it (a DataLoader
            worker): ``transform(sample)``, where ``sample`` is what ``dataset[index]`` returned. The cache holds
            the untransformed sample, so a random augmentation is drawn anew on every read. (Torchvision's
            ``transforms.v2`` accept ``(image, label)`` pairs as they are.) When ``dataset`` has a ``transform``,
            ``target_transform`` or ``transforms`` attribute that is not None, rank 0 warns once
            (:class:`~ignite_ext.data.cache.FrozenTransformWarning`): that one runs inside ``dataset[index]``
            and is cached.
        name: what the cache is of. ``None``: :func:`~ignite_ext.data.cache.identity.default_name`, the
            dataset's type, length and a cheap fingerprint of its public attributes, the same in every process.
            With ``scope="node"`` the ranks of a node pair their caches by the order of construction, and every
            rank raises unless the paired caches have the same name, the same samples at the first, middle and
            last index (:func:`~ignite_ext.data.cache.identity.sample_fingerprint`: each rank loads those three
            samples once at construction, outside the cache) and, with the default name, were constructed from
            the same line (:func:`~ignite_ext.data.cache.identity.construction_site`). So a rank that builds its
            validation cache first never reads the training samples. A ``name`` given stands for the line: it
            pairs caches of the same dataset constructed from different lines on different ranks.
        disk_dir: a directory on the node's own disk (never a shared filesystem, see
            :mod:`~ignite_ext.data.cache.disk`) for the disk tier; None: no disk tier. With ``scope="node"``
            every rank of a node must pass the same one (or None), and every rank checks its own.
        disk_bytes: bytes of sample data the disk tier may hold. ``None``: half of the free space of
            ``disk_dir`` at construction, less what this user's live caches there may still claim (split
            between the ranks of the node like ``capacity_bytes``). With ``scope="node"``, the local rank 0's.
        persist: keep the disk tier after the job (opt-in; needs ``disk_dir``, on the node's own disk): the next
            job on the node whose cache has the same identity (name, length, sampled content, ``version``, and
            for ``scope="rank"`` the local rank) serves from it at once. Every sample then goes to the disk tier
            (read through the page cache), none to RAM, so ``capacity_bytes`` does not apply. Each job checks a
            few samples against ``dataset`` when it opens one, and rebuilds it on a difference
            (:class:`~ignite_ext.data.cache.persist.StaleCacheWarning`); the user's persisted caches in a
            directory share a cap (``IGNITE_EXT_PERSIST_BYTES``, by default half of its filesystem), the least
            recently used deleted first. See :mod:`~ignite_ext.data.cache.persist` for what the identity sees.
        version: the user's name for the data's version (with ``persist``): a new one is a new cache. Pass one
            when files of the dataset change in place.

    Attributes:
        dataset: the wrapped dataset.
        scope: ``"rank"`` or ``"node"``.
        transform: what is applied after the cache, or None.
        name: the cache's name: the one given, or the default.
        disk_dir: the disk tier's directory (resolved), or None.

    Raises:
        ValueError: ``scope`` is unknown, ``capacity_bytes`` or ``disk_bytes`` is not positive, ``name`` is not a
            non-empty string, ``disk_bytes`` or ``persist`` comes without ``disk_dir``, ``capacity_bytes`` with
            ``persist``, ``version`` without ``persist``, ``disk_dir`` is not an existing,
            writable directory, or (node scope) the ranks of a node wrap datasets of different lengths, names,
            construction sites (default name) or sampled content, or pass different ``disk_dir``. With
            ``scope="node"`` on every rank, whichever rank it concerns.
        TypeError: ``transform`` is not callable.
        ShmSpaceError: ``/dev/shm`` cannot hold the cache (too little free space for the index plus 1 MiB of data
            by default, or less than ``capacity_bytes`` plus the index), or ``disk_dir`` cannot hold the disk
            tier (likewise, with ``disk_bytes``). With ``scope="node"`` on every rank.

    Examples:
        >>> import torch
        >>> from ignite_ext.data import CachedDataset
        >>> ds = CachedDataset([torch.full((2,), float(i)) for i in range(4)], capacity_bytes=1 << 20)
        >>> ds[1], ds[1]
        (tensor([1., 1.]), tensor([1., 1.]))
        >>> ds.stats()
        CacheStats(hits=1, misses=1, entries=1, bytes=72, disk_hits=0, disk_entries=0, disk_bytes=0, ...)
        >>> ds.close()

        A random augmentation after the cache is drawn anew on every read; the cache keeps the plain sample:

        >>> noisy = CachedDataset([torch.zeros(2)], capacity_bytes=1 << 20, transform=lambda x: x + torch.rand(2))
        >>> bool((noisy[0] != noisy[0]).all()), noisy.stats().hits
        (True, 1)
        >>> noisy.name
        'builtins.list[1]#...'
        >>> noisy.close()

        A disk tier takes what RAM cannot (here 64 bytes of RAM: room for one small sample):

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     tiered = CachedDataset(list(range(3)), capacity_bytes=64, disk_dir=directory, disk_bytes=1 << 20)
        ...     [tiered[i] for i in (0, 1, 0, 1)]
        ...     tiered.stats()
        ...     tiered.close()
        [0, 1, 0, 1]
        CacheStats(hits=2, misses=2, entries=2, bytes=60, disk_hits=1, disk_entries=1, disk_bytes=30, ...)

        With ``persist=True`` the disk tier outlives the job: the next one serves from it at once:

        >>> with tempfile.TemporaryDirectory() as directory:
        ...     job = CachedDataset(["a", "b"], disk_dir=directory, persist=True)
        ...     [job[i] for i in (0, 1)]
        ...     job.close()
        ...     nxt = CachedDataset(["a", "b"], disk_dir=directory, persist=True)
        ...     [nxt[i] for i in (0, 1)], nxt.stats().hits
        ...     nxt.close()
        ['a', 'b']
        (['a', 'b'], 2)

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``transform``, ``name``, ``disk_dir`` and ``disk_bytes``.
    .. versionchanged:: 0.3.0
       Node caches pair only caches constructed from the same line (default name) and of the same sampled content.
       ``persist`` and ``version``; a worker group restarted within its job adopts the caches it left.
    """

    def __init__(
        self,
        dataset: _MapStyle,
        *,
        scope: Scope = "rank",
        capacity_bytes: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        name: str | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int | None = None,
        persist: bool = False,
        version: str | None = None,
    ) -> None:
        if scope not in _SCOPES:
            raise ValueError(f"scope must be one of {_SCOPES}, got {scope!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {transform!r}")
        self.dataset = dataset
        self.scope: Scope = scope
        self.transform = transform
        self._len = len(dataset)
        idist = ignite_world()  # None: alone, and ignite is not imported for nothing (see ._world)
        if idist is None or idist.get_rank() == 0:
            warn_if_frozen(dataset, stacklevel=2)
        warn_if_forks_can_hang("CachedDataset made")
        if persist is True and capacity_bytes is not None:
            raise ValueError(
                "persist=True keeps every sample in the persisted disk tier (read through the page cache), none in "
                f"RAM: capacity_bytes={capacity_bytes} does not apply; leave it out, and size the tier with disk_bytes"
            )
        if scope == "node" and idist is not None and idist.get_world_size() > 1:
            self._tiers, self.name, disk = node_tiers(
                dataset, self._len, capacity_bytes, disk_dir, disk_bytes, name, persist, version
            )
            self._row = idist.get_local_rank()
        else:
            site = construction_site()
            self.name = checked_name(dataset, name)
            disk = disk_option(disk_dir, disk_bytes, persist, version)
            # Every rank of the node creates one at the same time: they split the default capacities evenly.
            peers, local_rank = 1, int(os.environ.get("LOCAL_RANK", "0"))
            if idist is not None and idist.get_world_size() > 1:
                peers, local_rank = idist.get_nproc_per_node(), idist.get_local_rank()
            # A restarted rank adopts the cache its predecessor of the same local rank left (see .restart).
            identity = ("rank", self.name, "" if name is not None else site, local_rank)
            persisted: tuple[object, ...] = ()
            if disk is not None and disk.persist:
                persisted = ("rank", self.name, self._len, sample_fingerprint(dataset), local_rank)
            self._tiers = create_tiers(
                self._len,
                capacity_bytes,
                disk,
                share=peers,
                identity=identity,
                persisted=persisted,
                stale=checker(dataset, self._len),
            )
            self._row = 0
        self.disk_dir = disk.directory if disk is not None else None
        self._slot: tuple[int, int] | None = None
        self._loading: LoadingAhead | None = None  # the process loading the next epoch's arrivals, if any
        # The pid that warned about an uncacheable sample: one warning per dataset and process (each DataLoader
        # worker is a process of its own and warns at most once), not one per read.
        self._warned_pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_slot"] = None
        state["_loading"] = None
        state["_rank"] = _orphans.owner()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        _orphans.watch(state.pop("_rank", None))
        self.__dict__.update(state)

    def __len__(self) -> int:
        return self._len

    @property
    def segment(self) -> str:
        """Path of the shared-memory file that holds the cache's RAM tier."""
        return self._tiers.ram.path

    @property
    def capacity_bytes(self) -> int:
        """Bytes of sample data the RAM tier can hold."""
        return self._tiers.ram.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of the RAM tier's data area in use: what it holds, and space nothing reuses yet.

        That is the samples stored, the bookkeeping of a cache that follows (:meth:`follow`), and ranges lost
        to a writer's crash or to another writer of the same sample. In a cache that follows, the space of evicted
        samples is reused before this grows.

        .. versionadded:: 0.4.0
        """
        return self._tiers.ram.used

    @property
    def disk_segment(self) -> str | None:
        """Path of the file in ``disk_dir`` that holds the disk tier, or None without one.

        .. versionadded:: 0.2.0
        """
        disk = self._tiers.disk
        return disk.path if disk is not None else None

    @property
    def disk_capacity_bytes(self) -> int:
        """Bytes of sample data the disk tier can hold (0 without one).

        .. versionadded:: 0.2.0
        """
        disk = self._tiers.disk
        return disk.capacity if disk is not None else 0

    def _count_slot(self) -> int:
        pid = _mapping.PID
        if self._slot is None or self._slot[0] != pid:
            info = get_worker_info()
            self._slot = (pid, 0 if info is None else info.id + 1)
            if info is not None:
                share_inherited_heap()  # before the worker's collector touches the rank's objects
        return self._slot[1]

    def _position(self, index: int) -> int:
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for a dataset of {self._len} samples")
        return i

    def __getitem__(self, index: int) -> Any:
        sample = self._read(self._position(index))
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """The samples at ``indices``: ``[self[i] for i in indices]``, for less. A DataLoader calls it per batch.

        The hits in RAM are served without the per-sample bookkeeping of ``self[i]`` and counted once per call,
        which matters when a sample is small enough for that bookkeeping to be a fair part of what reading it costs.

        Examples:
            >>> import torch
            >>> from ignite_ext.data import CachedDataset
            >>> ds = CachedDataset([torch.full((2,), float(i)) for i in range(4)], capacity_bytes=1 << 20)
            >>> [x[0].item() for x in ds.__getitems__([3, 1, 3])]
            [3.0, 1.0, 3.0]
            >>> ds.stats().hits, ds.stats().misses
            (1, 2)
            >>> ds.close()

        .. versionadded:: 0.2.0
        """
        ram = self._tiers.ram
        samples = []
        hits = 0
        try:
            for index in indices:
                i = self._position(index)
                raw = ram.lookup(i)
                if raw is None:
                    sample = self._read(i)  # on disk, or loaded: counted there
                else:
                    sample = decode(raw, ram.lender(i, raw))
                    hits += 1
                samples.append(sample if self.transform is None else self.transform(sample))
        finally:
            if hits:
                ram.count(self._row, self._count_slot(), hits=hits)
        return samples

    def _read(self, i: int) -> Any:
        """Sample ``i`` from the cache, or loaded (and stored if it can be); counted either way."""
        tiers = self._tiers
        found = tiers.find(i)
        if found is not None:
            arena, raw = found
            sample = decode(raw, arena.lender(i, raw))
            arena.count(self._row, self._count_slot(), hits=1)
            return sample
        sample = self.dataset[i]
        try:
            enc = encode(sample)
        except Exception as exc:  # e.g. an object pickle refuses: the sample is still good, only not cacheable
            if self._warned_pid != os.getpid():
                self._warned_pid = os.getpid()
                warnings.warn(
                    f"sample {i} cannot be cached and is served uncached (said once per process; later such "
                    f"samples are served uncached too): {exc!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            tiers.count_miss(self._row, self._count_slot())
            return sample
        stored = tiers.store(i, enc, self._before_publish)
        tiers.count_miss(self._row, self._count_slot(), stored, enc.nbytes)
        return sample  # already encoded: a transform that modifies it in place cannot reach the cache

    def follow(self, indices: Iterable[int], ahead: Iterable[int] = ()) -> bool:
        """Keep only ``indices`` in the cache: evict the other samples, and store new ones in the space they held.

        For a sampler whose shards change a little every epoch (a :class:`~ignite_ext.data.ShardedDistributedSampler`
        with ``mix > 0`` calls it for you, each epoch): given what the cache's readers read in the coming epoch
        (this rank's shard, or with ``scope="node"`` its node's), the samples that left are evicted and those that
        arrive are stored in their place as they are first read, so the cache holds the shard, not the shard plus
        everything that ever passed through it. Samples of ``indices`` not cached yet are not loaded here.

        From the first call on, the cache *follows*: every read copies the sample out of the cache (its space may
        be handed to another sample), large tensors and arrays included, which are otherwise lent copy-on-write;
        what was cached before the first call stays where it is. A call with the same indices as the call before
        does nothing, so every rank of a node may make the same call. Evictions are counted in
        :meth:`stats` (``evictions``, ``evicted_bytes``).

        With ``ahead`` (the samples that arrive next epoch; the sampler's ``load_ahead=True``), those are kept too,
        and loaded and stored meanwhile by a process this call starts (on a node cache, only on the node's local
        rank 0), niced below the DataLoader workers, until the first one the cache has no room for: next epoch
        they are hits. That process is killed at the next call and at :meth:`close`, and dies with the thread that
        started it. The cache then holds the shard plus the samples arriving next (``f`` of a shard more). A
        persisted cache (``persist=True``) does not follow: what it holds is for the next jobs too.

        Args:
            indices: the dataset indices to keep.
            ahead: indices to keep as well, and to load ahead of their first read.

        Returns:
            Whether the cache follows: False when its capacity cannot spare the bookkeeping (about 16 bytes per
            sample of the dataset); then nothing is evicted, as before.

        Raises:
            ValueError: an index is out of range.

        Examples:
            >>> import torch
            >>> from ignite_ext.data import CachedDataset
            >>> ds = CachedDataset([torch.full((4,), float(i)) for i in range(4)], capacity_bytes=1 << 20)
            >>> ds.follow([0, 1])
            True
            >>> [ds[i][0].item() for i in (0, 1)]
            [0.0, 1.0]
            >>> ds.follow([1, 2])  # 0 left the shard, 2 arrived
            True
            >>> ds[2][0].item(), ds.stats().evictions, ds.stats().entries
            (2.0, 1, 3)
            >>> ds.close()

        .. versionadded:: 0.4.0
        """
        self._stop_loading()
        upcoming = list(ahead)
        evicted, evicted_bytes, following = self._tiers.follow([*indices, *upcoming])
        if evicted:
            self._tiers.ram.count(self._row, self._count_slot(), evictions=evicted, evicted_bytes=evicted_bytes)
        if following and upcoming and self._row == 0:
            warn_if_forks_can_hang("The cache's load-ahead process forked")
            self._loading = LoadingAhead(self._load_ahead, upcoming)
        return following

    def _load_ahead(self, index: int) -> bool:
        """Load and store ``index`` unless a tier holds it (in the loading-ahead process); False: no room, stop.

        Every load is counted as loaded ahead (a storage read), stored or not.
        """
        tiers = self._tiers
        if tiers.holds(index):
            return True
        try:
            sample = self.dataset[index]
        except Exception:  # the sample's first read loads it again, and says there what failed
            return True
        slot = self._count_slot()
        try:
            enc = encode(sample)
        except Exception:  # uncacheable: its reads say so
            tiers.ram.count(self._row, slot, loaded_ahead=1)
            return True
        stored = tiers.store(index, enc, self._before_publish)
        tiers.ram.count(self._row, slot, loaded_ahead=1)
        if stored is not None:
            stored.count(self._row, slot, entries=1, nbytes=enc.nbytes)
            return True
        return tiers.holds(index)  # not stored and nobody else did: the cache is full

    def _stop_loading(self) -> None:
        loading, self._loading = self._loading, None
        if loading is not None:
            loading.stop()

    def _before_publish(self, index: int) -> None:
        """Run between writing a sample and publishing it; a seam for crash tests, nothing to do otherwise."""

    def stats(self, reduce: Reduce = "rank") -> CacheStats:
        """Hits (per tier), misses, entries and bytes, counted over this rank's main process and all its workers.

        Args:
            reduce: ``"rank"``: this rank only (no communication). ``"node"`` or ``"world"``: summed over the
                ranks of this node or of the world with a collective, so *every rank must call it*. With
                ``scope="node"`` the node sum of ``entries``/``bytes`` is what the node's cache holds.

        Raises:
            ValueError: ``reduce`` is not one of ``"rank"``, ``"node"``, ``"world"``, or the ranks that reduce
                passed different values. In a distributed job an invalid or mismatched value still takes part in
                the collective, and then every rank raises, so none is left waiting. (A rank that passes
                ``"rank"`` does not communicate: if the others reduce, they wait for it.)

        Examples:
            >>> from ignite_ext.data import CachedDataset
            >>> ds = CachedDataset(["a", "b"], capacity_bytes=1 << 20)
            >>> [ds[i] for i in (0, 1, 0)]
            ['a', 'b', 'a']
            >>> ds.stats(reduce="world").hits
            1
            >>> ds.close()

        .. versionadded:: 0.1.0
        """
        own = self._tiers.totals(self._row)
        idist = ignite_world()
        if reduce == "rank" or (reduce in _REDUCTIONS and (idist is None or idist.get_world_size() == 1)):
            return CacheStats(*own)
        if idist is None or idist.get_world_size() == 1:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {reduce!r}")

        from ignite_ext.distributed import agree
        from ignite_ext.distributed.agreement import disagreement

        node = idist.get_node_rank()

        def mine() -> tuple[str, int, tuple[int, ...]]:
            if reduce not in _REDUCTIONS:
                raise ValueError(f"reduce must be one of {_REDUCTIONS} and the same on every rank, got {reduce!r}")
            return reduce, node, own

        def differ(rows: list[tuple[str, int, tuple[int, ...]]]) -> str | None:
            asked = disagreement([r[0] for r in rows])
            return None if asked is None else f"reduce must be the same on every rank; by rank: {asked}"

        rows = agree(mine, "reducing the cache stats", check=differ)
        picked = [counters for _, nd, counters in rows if reduce == "world" or nd == node]
        return CacheStats(*(sum(column) for column in zip(*picked, strict=True)))

    def close(self) -> None:
        """Release the cache in this process; in the creating process also delete its files (both tiers).

        Processes that still map it (workers, other ranks) keep a valid mapping until they exit. The creating
        process also releases it when the dataset is garbage-collected or the interpreter exits.
        """
        self._stop_loading()
        self._tiers.close()
