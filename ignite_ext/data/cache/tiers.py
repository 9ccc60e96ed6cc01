"""Where a cache keeps its samples: a RAM arena in ``/dev/shm``, then, optionally, a disk arena in ``disk_dir``.

Both tiers are :class:`~ignite_ext.data.cache.arena.Arena` files of the same layout, with the same
publish-when-complete protocol, locks, liveness ``flock``, names and sweep; they differ only in where the file
is. The RAM one lives in a tmpfs, so its pages are RAM that nothing reclaims. The disk one lives in a node-local
directory (:mod:`~ignite_ext.data.cache.disk`) and is mapped the same way, so its hot pages are served from the
kernel's page cache, which the kernel reclaims under memory pressure (then a read goes to the disk).

*Placement*: a sample that was read and is in neither tier is stored in the first tier with room for it (the
RAM tier until its capacity is used, then the disk tier until ``disk_bytes`` is used); when neither has room, it
is served uncached. *Lookup*: RAM first, then disk. A sample is stored at most once per tier; two processes
missing the same index at the same moment may, rarely, store it once in each tier (the RAM copy then serves it).

*Counting*: each tier counts its own hits, entries and bytes in its own counter slots; misses are counted in the
RAM tier. :meth:`Tiers.totals` adds them up in the order of
:class:`~ignite_ext.data.cache.stats.CacheStats`' fields.

*Creation*: :func:`create_tiers` in one process; :func:`node_tiers` for a node, collectively: one
:func:`~ignite_ext.distributed.agree` in which every rank checks its own arguments (name, ``disk_dir``,
``disk_bytes``), fingerprints its dataset's samples (:mod:`~ignite_ext.data.cache.identity`) and the node's local
rank 0 creates both files, so a bad argument or a sample that fails to load on any rank, caches that do not pair
(name, construction site, samples), or a tier that does not fit on a creating rank, raise on every rank.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import Encoded
from ignite_ext.data.cache.disk import NetworkFilesystemWarning, check_disk_dir, network_filesystem
from ignite_ext.data.cache.identity import checked_name, construction_site, fingerprint_indices, sample_fingerprint
from ignite_ext.data.cache.restart import NO_JOB, cache_key, job_key

__all__ = ["DiskOption", "Tiers", "create_tiers", "disk_option", "node_tiers"]


@dataclass(frozen=True)
class DiskOption:
    """A disk tier asked for: its directory (resolved) and its capacity (``None``: the default)."""

    directory: str
    nbytes: int | None


def disk_option(disk_dir: str | os.PathLike[str] | None, disk_bytes: int | None) -> DiskOption | None:
    """The disk tier that ``disk_dir`` and ``disk_bytes`` ask for, checked; None when they ask for none.

    Raises:
        ValueError: ``disk_bytes`` without ``disk_dir``, ``disk_bytes`` not a positive integer, or a bad
            ``disk_dir`` (see :func:`~ignite_ext.data.cache.disk.check_disk_dir`).

    Examples:
        >>> from ignite_ext.data.cache.tiers import disk_option
        >>> disk_option(None, None) is None
        True
        >>> import tempfile
        >>> disk_option(tempfile.gettempdir(), 1 << 20).nbytes
        1048576
        >>> disk_option(None, 1 << 20)
        Traceback (most recent call last):
        ...
        ValueError: disk_bytes=1048576 needs a disk_dir

    .. versionadded:: 0.2.0
    """
    if disk_dir is None:
        if disk_bytes is not None:
            raise ValueError(f"disk_bytes={disk_bytes} needs a disk_dir")
        return None
    if disk_bytes is not None and (isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes <= 0):
        raise ValueError(f"disk_bytes must be a positive number of bytes, got {disk_bytes!r}")
    return DiskOption(check_disk_dir(disk_dir), disk_bytes)


class Tiers:
    """The arenas of one cache, fastest first: RAM, then the disk tier if there is one.

    It pickles as its arenas, that is as their paths (see :class:`~ignite_ext.data.cache.arena.Arena`).

    Examples:
        >>> import shutil, tempfile
        >>> from ignite_ext.data.cache.codec import encode
        >>> from ignite_ext.data.cache.tiers import DiskOption, create_tiers
        >>> directory = tempfile.mkdtemp()
        >>> tiers = create_tiers(2, 64, DiskOption(directory, 1 << 20))  # 64 bytes of RAM: too few for a sample
        >>> tiers.store(0, encode(list(range(20))), lambda index: None) is tiers.disk
        True
        >>> arena, raw = tiers.find(0)
        >>> arena is tiers.disk, tiers.find(1)
        (True, None)
        >>> tiers.close()
        >>> shutil.rmtree(directory)

    .. versionadded:: 0.2.0
    """

    def __init__(self, arenas: Sequence[Arena]) -> None:
        self.arenas = tuple(arenas)

    @property
    def ram(self) -> Arena:
        """The RAM tier (``/dev/shm``)."""
        return self.arenas[0]

    @property
    def disk(self) -> Arena | None:
        """The disk tier, or None."""
        return self.arenas[1] if len(self.arenas) > 1 else None

    def find(self, index: int) -> tuple[Arena, memoryview] | None:
        """The first tier that holds ``index``, and the published bytes there; None if no tier does."""
        for arena in self.arenas:
            raw = arena.lookup(index)
            if raw is not None:
                return arena, raw
        return None

    def store(self, index: int, enc: Encoded, before_publish: Callable[[int], None]) -> Arena | None:
        """Store ``enc`` as ``index`` in the first tier with room; return that tier, or None if it was not stored.

        ``before_publish(index)`` runs between writing the bytes and publishing them. Not stored: no tier has room,
        or another process stored the index first (then no further tier is tried).
        """
        for arena in self.arenas:
            offset = arena.reserve(index, enc.nbytes, enc.page_offset)
            if offset is None:
                if arena.lookup(index) is not None:  # another process published it meanwhile
                    return None
                continue  # no room here: the next tier
            enc.write_into(arena.data_view(offset, enc.nbytes))
            before_publish(index)
            return arena if arena.publish(index, offset, enc.nbytes) else None
        return None

    def count_miss(self, row: int, slot: int, stored: Arena | None = None, nbytes: int = 0) -> None:
        """Count a miss (in the RAM tier) and, when the sample was stored, an entry of ``nbytes`` in ``stored``."""
        ram = self.ram
        if stored is ram:
            ram.count(row, slot, misses=1, entries=1, nbytes=nbytes)
            return
        ram.count(row, slot, misses=1)
        if stored is not None:
            stored.count(row, slot, entries=1, nbytes=nbytes)

    def totals(self, row: int) -> tuple[int, int, int, int, int, int, int]:
        """``(hits, misses, entries, bytes, disk_hits, disk_entries, disk_bytes)`` of ``row`` (a rank)."""
        hits, misses, entries, nbytes = self.ram.totals(row)
        disk = self.disk
        disk_hits, _, disk_entries, disk_bytes = disk.totals(row) if disk is not None else (0, 0, 0, 0)
        return (
            hits + disk_hits,
            misses,
            entries + disk_entries,
            nbytes + disk_bytes,
            disk_hits,
            disk_entries,
            disk_bytes,
        )

    def close(self) -> None:
        """Close every tier (see :meth:`Arena.close <ignite_ext.data.cache.arena.Arena.close>`)."""
        for arena in self.arenas:
            arena.close()


def create_tiers(
    n: int,
    capacity: int | None,
    disk: DiskOption | None,
    rows: int = 1,
    share: int = 1,
    identity: tuple[object, ...] | None = None,
) -> Tiers:
    """Create the RAM arena and, with ``disk``, the disk arena of a cache of ``n`` samples, owned by this process.

    ``rows`` and ``share`` are those of :meth:`Arena.create <ignite_ext.data.cache.arena.Arena.create>`. A disk
    directory on a network filesystem gets a :class:`~ignite_ext.data.cache.disk.NetworkFilesystemWarning` and
    is not swept. With ``identity`` (what tells this cache from the job's others), each tier adopts the arena
    the attempt before of a restarted worker group left of the same cache, if any
    (:mod:`~ignite_ext.data.cache.restart`).

    .. versionchanged:: 0.3.0
       ``identity``.

    Raises:
        ShmSpaceError: a tier does not fit its directory (then neither file is left).

    .. versionadded:: 0.2.0
    """
    job = job_key() if identity is not None else NO_JOB
    stamp = identity or ()
    ram = Arena.create(n, capacity, rows=rows, share=share, job=job, key=cache_key(*stamp, "ram"))
    if disk is None:
        return Tiers([ram])
    try:
        network = network_filesystem(disk.directory)
        if network is not None:
            warnings.warn(
                f"disk_dir={disk.directory!r} is on a {network} filesystem, which other hosts mount: the disk tier "
                "should be on this node's own disk (reading it costs network traffic, and its stale files can "
                "only be swept on a local disk, so they are left there). Pass a node-local directory.",
                NetworkFilesystemWarning,
                stacklevel=3,
            )
        on_disk = Arena.create(
            n,
            disk.nbytes,
            rows=rows,
            directory=disk.directory,
            share=share,
            knob="disk_bytes",
            advice=f"free space in {disk.directory}",
            sweep=network is None,
            job=job,
            key=cache_key(*stamp, "disk", disk.directory),
        )
    except BaseException:
        ram.close()
        raise
    return Tiers([ram, on_disk])


class _Setup(NamedTuple):
    """What one rank brings to a node cache's construction; the ranks of each node must bring the same."""

    node: int
    local_rank: int
    length: int
    name: str
    given: bool  # name= was given: it stands for the construction site too
    site: str
    samples: str  # sample_fingerprint, or "" on a node of one rank (nothing to pair)
    disk_dir: str | None
    paths: tuple[str, ...]

    def identity(self) -> str:
        """What pairs this cache, as the error shows it: exactly what is compared."""
        what = f"{self.name!r} (given)" if self.given else f"{self.name} from {self.site}"
        return f"{what}, samples #{self.samples}" if self.samples else what


def node_tiers(
    dataset: Any,
    n: int,
    capacity: int | None,
    disk_dir: str | os.PathLike[str] | None,
    disk_bytes: int | None,
    name: str | None,
) -> tuple[Tiers, str, DiskOption | None]:
    """Create the node's tiers on its local rank 0 and attach them on the other ranks of the node (collective).

    Every rank sends its node, local rank, length, cache name, construction site
    (:func:`~ignite_ext.data.cache.identity.construction_site`), sample fingerprint
    (:func:`~ignite_ext.data.cache.identity.sample_fingerprint`, on nodes of more than one rank), checked
    ``disk_dir`` and (local rank 0) the paths of the tiers it created; the ranks of each node must agree on the
    length, the name, the site (unless ``name`` is given), the fingerprint and the ``disk_dir``, or every rank
    raises. Returns the tiers, this rank's name and its disk option.

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.3.0
       The construction site and the sample fingerprint must agree too.
    """
    import ignite.distributed as idist

    from ignite_ext.distributed import agree
    from ignite_ext.distributed.agreement import disagreement

    node, local_rank = idist.get_node_rank(), idist.get_local_rank()
    # Outside the agreed step, so that every rank counts this construction even where the step fails on one rank:
    # the next construction at this line must still pair with the others' next one.
    site = construction_site()
    created: list[Tiers] = []
    disk: list[DiskOption | None] = []

    def setup() -> _Setup:
        mine = checked_name(dataset, name)
        disk.append(disk_option(disk_dir, disk_bytes))
        # Inside the agreed step: a sample that fails to load fails the construction on every rank.
        samples = sample_fingerprint(dataset) if idist.get_nproc_per_node() > 1 else ""
        if local_rank == 0:
            identity = ("node", mine, "" if name is not None else site, samples)
            created.append(create_tiers(n, capacity, disk[0], rows=idist.get_nproc_per_node(), identity=identity))
        paths = tuple(a.path for a in created[0].arenas) if created else ()
        directory = disk[0].directory if disk[0] is not None else None
        return _Setup(node, local_rank, n, mine, name is not None, site, samples, directory, paths)

    def differ(entries: list[_Setup]) -> str | None:
        lengths = sorted({(e.node, e.length) for e in entries})
        if len(lengths) != len({e.node for e in entries}):
            return f"ranks of one node wrap datasets of different lengths (node, length): {lengths}"
        named, sampled, dirs = [], [], []
        for nd in sorted({e.node for e in entries}):
            on_node = sorted((e for e in entries if e.node == nd), key=lambda e: e.local_rank)
            if (problem := disagreement([e.identity() for e in on_node])) is not None:
                pairs = {(e.name, e.given, "" if e.given else e.site) for e in on_node}
                if len(pairs) > 1:
                    named.append(f"node {nd}, by local rank: {problem}")
                else:
                    at = list(fingerprint_indices(on_node[0].length))
                    sampled.append(f"node {nd}, samples at indices {at}, by local rank: {problem}")
            if (problem := disagreement([e.disk_dir for e in on_node])) is not None:
                dirs.append(f"node {nd}, by local rank: {problem}")
        if named:
            return (
                f"ranks of one node construct different caches at this call ({'; '.join(named)}). Construct the "
                "node caches in the same order on every rank (each one from the same line of code on all of them), "
                "or, if these are the same dataset, pass the same name= on every rank"
            )
        if sampled:
            return (
                f"ranks of one node construct caches of different samples at this call ({'; '.join(sampled)}): "
                "these are different datasets (a name= pairs only caches of the same samples). Construct the node "
                "caches in the same order on every rank; a dataset whose samples differ between ranks (drawn from "
                'a random generator of its own, or depending on the rank) cannot share a node cache: use scope="rank"'
            )
        if dirs:
            return (
                f"ranks of one node pass different disk_dir ({'; '.join(dirs)}): a node cache has one disk tier, "
                "shared by the node's ranks; pass the same directory (or None) on every rank of the node"
            )
        return None

    try:
        entries = agree(setup, "creating the node cache", check=differ)
    except BaseException:
        for tiers in created:  # another rank failed: this rank's files are of no use to anyone
            tiers.close()
        raise
    own = next(e for e in entries if e.node == node and e.local_rank == local_rank)
    if created:
        return created[0], own.name, disk[0]
    paths = next(e.paths for e in entries if e.node == node and e.local_rank == 0)
    return Tiers([Arena.attach(path) for path in paths]), own.name, disk[0]
