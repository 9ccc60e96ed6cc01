"""A shared in-memory sample cache for map-style datasets: load once, then serve every worker and rank from RAM.

:class:`CachedDataset` wraps any map-style dataset. The first read of an index loads it from the wrapped dataset and
stores it, serialised compactly, in a shared-memory arena (:mod:`ignite_ext.data.cache.arena`); every later read of that
index by any DataLoader worker of the rank (``scope="rank"``) or by any rank of the node (``scope="node"``) is
served from there: small tensors and arrays are copied out, large ones lent as private copy-on-write views
(:mod:`ignite_ext.data.cache._cow`). See the cache guide for the guarantees, the memory model and the sampler pairings.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import functools
import operator
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from torch.utils.data import Dataset, get_worker_info

from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import decode, encode
from ignite_ext.data.cache.identity import default_name
from ignite_ext.data.cache.transforms import FrozenTransformWarning, warn_if_frozen

# ignite and ignite_ext.distributed are imported where a rank's main process needs them (construction, stats):
# a DataLoader worker that unpickles the dataset (spawn) then loads neither, which keeps its memory down.

__all__ = ["CacheStats", "CachedDataset", "FrozenTransformWarning"]  # the warning re-exported: users meet it here

Scope = Literal["rank", "node"]
Reduce = Literal["rank", "node", "world"]
_SCOPES = ("rank", "node")
_REDUCTIONS = ("rank", "node", "world")


class _MapStyle(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


@dataclass(frozen=True)
class CacheStats:
    """Counters of a :class:`CachedDataset`.

    Args:
        hits: reads served from the cache.
        misses: reads that loaded from the wrapped dataset (including those that could not be stored because
            the cache was full, or because another process stored the index first).
        entries: samples stored in the cache (by the processes counted).
        bytes: bytes of those samples in the cache.

    Examples:
        >>> from ignite_ext.data import CacheStats
        >>> s = CacheStats(hits=3, misses=1, entries=1, bytes=128)
        >>> s.hit_rate
        0.75
        >>> s - CacheStats(hits=1, misses=1, entries=1, bytes=128)
        CacheStats(hits=2, misses=0, entries=0, bytes=0)

    .. versionadded:: 0.1.0
    """

    hits: int = 0
    misses: int = 0
    entries: int = 0
    bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``, or 0.0 before any read."""
        reads = self.hits + self.misses
        return self.hits / reads if reads else 0.0

    def __sub__(self, other: CacheStats) -> CacheStats:
        return CacheStats(
            self.hits - other.hits, self.misses - other.misses, self.entries - other.entries, self.bytes - other.bytes
        )


class CachedDataset(Dataset[Any]):
    """Serve the samples of ``dataset`` from a shared-memory cache after their first load.

    The cache is created in the constructing process (a rank's main process) and reaches DataLoader workers by
    pickling (of the cache, only its shared-memory name travels; workers map it on first use), so it works with the
    ``fork`` and ``spawn`` start methods and with or without ``persistent_workers``. Samples are stored as a small
    header plus the raw bytes of their tensors and arrays. Every read returns tensors and arrays of its own (copies
    under 64 KiB, private copy-on-write views of the cache from 64 KiB up, which cost no copy unless written to):
    modifying a sample never changes the cache, nor what a later read gets. Nothing is evicted: once the cache is
    full, samples not in it are loaded from ``dataset`` each time they are read (and counted as misses).

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
        name: what the cache is of. With ``scope="node"`` the ranks of a node must construct caches of the same
            name at the same call, or every rank raises (a rank that builds its validation cache first never
            reads the training samples). ``None``: :func:`~ignite_ext.data.cache.identity.default_name`, the
            dataset's type, length and a cheap fingerprint of its public attributes, the same in every process.

    Attributes:
        dataset: the wrapped dataset.
        scope: ``"rank"`` or ``"node"``.
        transform: what is applied after the cache, or None.
        name: the cache's name: the one given, or the default.

    Raises:
        ValueError: ``scope`` is unknown, ``capacity_bytes`` is not positive, ``name`` is not a non-empty
            string, or (node scope) the ranks of a node wrap datasets of different lengths or names.
        TypeError: ``transform`` is not callable.
        ShmSpaceError: ``/dev/shm`` cannot hold the cache (too little free space for the index plus 1 MiB of data
            by default, or less than ``capacity_bytes`` plus the index).

    Examples:
        >>> import torch
        >>> from ignite_ext.data import CachedDataset
        >>> ds = CachedDataset([torch.full((2,), float(i)) for i in range(4)], capacity_bytes=1 << 20)
        >>> ds[1], ds[1]
        (tensor([1., 1.]), tensor([1., 1.]))
        >>> ds.stats()
        CacheStats(hits=1, misses=1, entries=1, bytes=72)
        >>> ds.close()

        A random augmentation after the cache is drawn anew on every read; the cache keeps the plain sample:

        >>> noisy = CachedDataset([torch.zeros(2)], capacity_bytes=1 << 20, transform=lambda x: x + torch.rand(2))
        >>> bool((noisy[0] != noisy[0]).all()), noisy.stats().hits
        (True, 1)
        >>> noisy.name
        'builtins.list[1]#...'
        >>> noisy.close()

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
       ``transform`` and ``name``.
    """

    def __init__(
        self,
        dataset: _MapStyle,
        *,
        scope: Scope = "rank",
        capacity_bytes: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        name: str | None = None,
    ) -> None:
        import ignite.distributed as idist

        if scope not in _SCOPES:
            raise ValueError(f"scope must be one of {_SCOPES}, got {scope!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {transform!r}")
        self.dataset = dataset
        self.scope: Scope = scope
        self.transform = transform
        self._len = len(dataset)
        if idist.get_rank() == 0:
            warn_if_frozen(dataset, stacklevel=2)
        if scope == "node" and idist.get_world_size() > 1:
            self._arena, self.name = _node_arena(dataset, self._len, capacity_bytes, name)
            self._row = idist.get_local_rank()
        else:
            self.name = _checked_name(dataset, name)
            # Every rank of the node creates one at the same time: they split the default capacity evenly.
            peers = idist.get_nproc_per_node() if idist.get_world_size() > 1 else 1
            self._arena, self._row = Arena.create(self._len, capacity_bytes, share=peers), 0
        self._slot: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_slot"] = None
        return state

    def __len__(self) -> int:
        return self._len

    @property
    def segment(self) -> str:
        """Path of the shared-memory file that holds the cache."""
        return self._arena.path

    @property
    def capacity_bytes(self) -> int:
        """Bytes of sample data the cache can hold."""
        return self._arena.capacity

    def _count_slot(self) -> int:
        pid = os.getpid()
        if self._slot is None or self._slot[0] != pid:
            info = get_worker_info()
            self._slot = (pid, 0 if info is None else info.id + 1)
        return self._slot[1]

    def __getitem__(self, index: int) -> Any:
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for a dataset of {self._len} samples")
        sample = self._read(i)
        return sample if self.transform is None else self.transform(sample)

    def _read(self, i: int) -> Any:
        """Sample ``i`` from the cache, or loaded (and stored if it can be); counted either way."""
        arena = self._arena
        raw = arena.lookup(i)
        if raw is not None:
            sample = decode(raw, functools.partial(arena.borrow, i))
            arena.count(self._row, self._count_slot(), hits=1)
            return sample
        sample = self.dataset[i]
        try:
            enc = encode(sample)
        except Exception as exc:  # e.g. an object pickle refuses: the sample is still good, only not cacheable
            warnings.warn(f"sample {i} cannot be cached and is served uncached: {exc!r}", RuntimeWarning, stacklevel=3)
            arena.count(self._row, self._count_slot(), misses=1)
            return sample
        offset = arena.reserve(i, enc.nbytes, enc.page_offset)
        published = False
        if offset is not None:
            enc.write_into(arena.data_view(offset, enc.nbytes))
            self._before_publish(i)
            published = arena.publish(i, offset, enc.nbytes)
        arena.count(
            self._row, self._count_slot(), misses=1, entries=int(published), nbytes=enc.nbytes if published else 0
        )
        return sample  # already encoded: a transform that modifies it in place cannot reach the cache

    def _before_publish(self, index: int) -> None:
        """Run between writing a sample and publishing it; a seam for crash tests, nothing to do otherwise."""

    def stats(self, reduce: Reduce = "rank") -> CacheStats:
        """Hits, misses, entries and bytes, counted over this rank's main process and all its DataLoader workers.

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
        import ignite.distributed as idist

        from ignite_ext.distributed import agree
        from ignite_ext.distributed.agreement import disagreement

        own = self._arena.totals(self._row)
        distributed = idist.get_world_size() > 1
        if reduce == "rank" or (reduce in _REDUCTIONS and not distributed):
            return CacheStats(*own)
        if not distributed:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        node = idist.get_node_rank()

        def mine() -> tuple[str, int, tuple[int, int, int, int]]:
            if reduce not in _REDUCTIONS:
                raise ValueError(f"reduce must be one of {_REDUCTIONS} and the same on every rank, got {reduce!r}")
            return reduce, node, own

        def differ(rows: list[tuple[str, int, tuple[int, int, int, int]]]) -> str | None:
            asked = disagreement([r[0] for r in rows])
            return None if asked is None else f"reduce must be the same on every rank; by rank: {asked}"

        rows = agree(mine, "reducing the cache stats", check=differ)
        picked = [counters for _, nd, counters in rows if reduce == "world" or nd == node]
        hits, misses, entries, nbytes = (sum(column) for column in zip(*picked, strict=True))
        return CacheStats(hits, misses, entries, nbytes)

    def close(self) -> None:
        """Release the cache in this process; in the creating process also delete its shared memory.

        Processes that still map it (workers, other ranks) keep a valid mapping until they exit. The creating
        process also releases it when the dataset is garbage-collected or the interpreter exits.
        """
        self._arena.close()


def _checked_name(dataset: Any, name: str | None) -> str:
    if name is None:
        return default_name(dataset)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


def _node_arena(dataset: Any, n: int, capacity_bytes: int | None, name: str | None) -> tuple[Arena, str]:
    """Create the node's arena on its local rank 0 and attach it on the other ranks of the node (collective).

    Every rank sends its node, local rank, length, cache name and (local rank 0) the arena's path; the ranks of
    each node must agree on the length and the name, or every rank raises.
    """
    import ignite.distributed as idist

    from ignite_ext.distributed import agree
    from ignite_ext.distributed.agreement import disagreement

    node, local_rank = idist.get_node_rank(), idist.get_local_rank()
    created: list[Arena] = []

    def setup() -> tuple[int, int, int, str, str]:
        mine = _checked_name(dataset, name)
        if local_rank == 0:
            created.append(Arena.create(n, capacity_bytes, rows=idist.get_nproc_per_node()))
        return node, local_rank, n, mine, created[0].path if created else ""

    def differ(entries: list[tuple[int, int, int, str, str]]) -> str | None:
        lengths = sorted({(e[0], e[2]) for e in entries})
        if len(lengths) != len({e[0] for e in entries}):
            return f"ranks of one node wrap datasets of different lengths (node, length): {lengths}"
        names = []
        for nd in sorted({e[0] for e in entries}):
            by_local_rank = [e[3] for e in sorted(e for e in entries if e[0] == nd)]
            if (problem := disagreement(by_local_rank)) is not None:
                names.append(f"node {nd}, by local rank: {problem}")
        if not names:
            return None
        return (
            f"ranks of one node construct different caches at this call ({'; '.join(names)}). Construct the "
            "node caches in the same order on every rank, or, if these are the same dataset, pass the same "
            "name= on every rank"
        )

    entries = agree(setup, "creating the node cache", check=differ)
    mine = next(e[3] for e in entries if e[0] == node and e[1] == local_rank)
    if created:
        return created[0], mine
    return Arena.attach(next(e[4] for e in entries if e[0] == node and e[1] == 0)), mine
