"""A shared in-memory sample cache for map-style datasets: load once, then serve every worker and rank from RAM.

See the cache guide for the guarantees, the memory model and the sampler pairings.

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
from ignite_ext.data.cache._world import ignite_world
from ignite_ext.data.cache.codec import LENDABLE, decode, encode
from ignite_ext.data.cache.identity import checked_name, construction_site, sample_fingerprint
from ignite_ext.data.cache.stats import CacheStats
from ignite_ext.data.cache.tiers import checker, create_tiers, disk_option, node_tiers
from ignite_ext.data.cache.transforms import FrozenTransformWarning, warn_if_frozen
from ignite_ext.data.fork_memory import arm, share_inherited_heap
from ignite_ext.data.fork_safety import warn_if_forks_can_hang

# ignite and ignite_ext.distributed are imported only where a rank's main process needs them (see ._world).

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
    pickling (only its files' names travel), with any start method, persistent workers or not. Every read returns
    tensors and arrays of its own (copies under 128 KiB, private copy-on-write views from 128 KiB up): modifying a
    sample never changes the cache. Nothing is evicted: once the cache is full, samples not in it are loaded from
    ``dataset`` at each read (misses), unless the cache is told what its readers will read (:meth:`follow`). With
    ``disk_dir``, what does not fit ``capacity_bytes`` goes to a disk tier of the same guarantees.

    Args:
        dataset: a map-style dataset (``len()`` and integer indexing).
        scope: ``"rank"``: one cache per constructing process, shared by its DataLoader workers. ``"node"``: one
            per node, shared by its ranks, which all construct it (a collective); local rank 0 creates it.
        capacity_bytes: bytes of sample data the cache may hold. ``None``: half of ``/dev/shm``'s free space less
            what this user's live caches may still claim (with ``scope="rank"``, split between the node's ranks).
        transform: applied to every sample read, after the cache, in the process that reads it:
            ``transform(dataset[index])``, so a random augmentation is drawn anew on every read. A ``transform``
            (``target_transform``, ``transforms``) attribute of ``dataset`` runs inside it and is cached: rank 0
            warns (:class:`~ignite_ext.data.cache.FrozenTransformWarning`).
        name: what the cache is of; ``None``: :func:`~ignite_ext.data.cache.identity.default_name`. A node's ranks
            pair their node caches by the order of construction, and raise unless the pairs have the same name,
            samples and, with the default name, construction line (see :mod:`~ignite_ext.data.cache.identity`).
        disk_dir: a directory on the node's own disk (never a shared filesystem, see
            :mod:`~ignite_ext.data.cache.disk`) for the disk tier; None: no disk tier. With ``scope="node"``
            every rank of a node must pass the same one (or None), and every rank checks its own.
        disk_bytes: bytes of sample data the disk tier may hold; ``None``: as ``capacity_bytes``, in ``disk_dir``.
        persist: keep the disk tier after the job (needs ``disk_dir``): the next job on the node whose cache has
            the same identity serves from it at once. Every sample then goes to the disk tier, none to RAM
            (``capacity_bytes`` does not apply). See :mod:`~ignite_ext.data.cache.persist`.
        version: the user's name for the data's version (with ``persist``): a new one is a new cache. Pass one
            when files of the dataset change in place.

    Attributes:
        dataset: the wrapped dataset.
        scope: ``"rank"`` or ``"node"``.
        transform: what is applied after the cache, or None.
        name: the cache's name: the one given, or the default.
        disk_dir: the disk tier's directory (resolved), or None.

    Raises:
        ValueError: an argument is invalid or does not go with the others, ``disk_dir`` is not an existing,
            writable directory, or (node scope) the paired caches of a node differ. With ``scope="node"`` on every
            rank, whichever rank it concerns.
        TypeError: ``transform`` is not callable.
        ShmSpaceError: ``/dev/shm`` (or ``disk_dir``) cannot hold the tier: less free space than its index plus
            1 MiB by default, or plus ``capacity_bytes`` (``disk_bytes``). With ``scope="node"`` on every rank.

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
        warn_if_forks_can_hang("CachedDataset")
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
        # The pid that warned about an uncacheable sample: one warning per dataset and process, not one per read.
        self._warned_pid: int | None = None
        arm()  # from now on this process freezes its heap before it forks (its workers share it)

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

        That is the samples stored, a following cache's bookkeeping and the space of evicted samples (reused before
        this grows), and ranges lost to a writer's crash or to another writer of the same sample.

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

        The hits in RAM are served without the per-sample bookkeeping of ``self[i]``, counted once per call.

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
                    # Nothing to lend in a smaller sample: no lender built (3 % of a 64 KiB hit).
                    sample = decode(raw, ram.lender(i, raw) if raw.nbytes >= LENDABLE else None)
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
            sample = decode(raw, arena.lender(i, raw) if raw.nbytes >= LENDABLE else None)
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
        with ``mix > 0`` calls it each epoch): the samples that left the coming epoch's shard are evicted, and
        those that arrive are stored in their place as they are first read. From the first call on, the cache
        *follows*: every read copies the sample out (large ones included); what was cached before stays where it
        is. A call with the indices of the call before does nothing, so every rank of a node may make it.

        With ``ahead`` (the sampler's ``load_ahead=True``), those samples are kept too, and loaded meanwhile by a
        niced process this call starts (on a node cache, on local rank 0 only) until the cache is full; it is
        killed at the next call and at :meth:`close`. A persisted cache does not follow. See the cache guide's
        *Following shards that mix*.

        Args:
            indices: the dataset indices to keep.
            ahead: indices to keep as well, and to load ahead of their first read.

        Returns:
            Whether the cache follows: False (nothing evicted) when its capacity cannot spare the bookkeeping.

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
            warn_if_forks_can_hang("CachedDataset")
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
                ranks of this node or of the world with a collective, so *every rank must call it*.

        Raises:
            ValueError: ``reduce`` is unknown, or the ranks that reduce passed different values: then every rank
                raises, none is left waiting (a rank that passes ``"rank"`` does not communicate).

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
