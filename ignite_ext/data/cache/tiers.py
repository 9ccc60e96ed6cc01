"""Where a cache keeps its samples: its tiers, fastest first (RAM in ``/dev/shm``, then any disk tiers).

Every tier is an :class:`~ignite_ext.data.cache.arena.Arena` file of the same layout and protocol; a :class:`Tier`
says where it lives and by what rules it is made (see the cache guide's *The disk tier* for the page cache's part).
*Placement*: a sample read and held by no tier goes to the first tier with room for it, or is served uncached.
*Lookup*: fastest first; two processes missing one index at once may, rarely, store it in two tiers. *Counting*:
each tier counts its own hits, entries and bytes; misses and loads ahead count in the first (:meth:`Tiers.totals`).
:func:`node_tiers` makes a node's tiers in one :func:`~ignite_ext.distributed.agree`: a bad argument, a sample
that fails to load, caches that do not pair or a tier that does not fit, on any rank, raise on every rank.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ignite_ext.data.cache._mapping import ALIGN
from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import Encoded
from ignite_ext.data.cache.disk import NetworkFilesystemWarning, check_disk_dir, network_filesystem
from ignite_ext.data.cache.identity import checked_name, construction_site, fingerprint_indices, sample_fingerprint
from ignite_ext.data.cache.persist import StaleCacheWarning, persist_key, stale_sample
from ignite_ext.data.cache.restart import NO_JOB, cache_key, job_key

# fmt: off
__all__ = [
    "DiskOption", "DiskTier", "RamTier", "Tier", "Tiers", "checker", "create_tiers", "disk_option", "node_tiers",
    "open_tiers", "persisted_as",
]
# fmt: on


@dataclass(frozen=True)
class DiskOption:
    """A disk tier asked for: directory (resolved), capacity (``None``: the default), persistence, data version."""

    directory: str
    nbytes: int | None
    persist: bool = False
    version: str | None = None


def disk_option(
    disk_dir: str | os.PathLike[str] | None, disk_bytes: int | None, persist: bool = False, version: str | None = None
) -> DiskOption | None:
    """The disk tier that ``disk_dir``, ``disk_bytes``, ``persist`` and ``version`` ask for, checked; None for none.

    Raises:
        ValueError: an argument is invalid, comes without another it needs, or ``disk_dir`` is bad (see
            :func:`~ignite_ext.data.cache.disk.check_disk_dir`).

    Examples:
        >>> import tempfile
        >>> from ignite_ext.data.cache.tiers import disk_option
        >>> disk_option(None, None) is None, disk_option(tempfile.gettempdir(), 1 << 20).nbytes
        (True, 1048576)
        >>> disk_option(None, 1 << 20)
        Traceback (most recent call last):
        ...
        ValueError: disk_bytes=1048576 needs a disk_dir

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.3.0
       ``persist`` and ``version``.
    """
    if not isinstance(persist, bool):
        raise ValueError(f"persist must be True or False, got {persist!r}")
    if version is not None and (not persist or not isinstance(version, str)):
        raise ValueError(f"version= names the data of a persisted cache (persist=True), as a string; got {version!r}")
    if disk_dir is None:
        if disk_bytes is not None:
            raise ValueError(f"disk_bytes={disk_bytes} needs a disk_dir")
        if persist:
            raise ValueError("persist=True keeps the disk tier after the job: it needs a disk_dir")
        return None
    if disk_bytes is not None and (isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes <= 0):
        raise ValueError(f"disk_bytes must be a positive number of bytes, got {disk_bytes!r}")
    return DiskOption(check_disk_dir(disk_dir), disk_bytes, persist, version)


class Tier(Protocol):
    """A kind of tier: where its file lives and by what rules it is made; one implementation per kind of storage.

    What it opens is an :class:`~ignite_ext.data.cache.arena.Arena` (the store every tier shares: the sample table,
    the space, the counters), so :class:`Tiers` composes any number of them, fastest first, without knowing their
    kinds. :class:`RamTier` and :class:`DiskTier` are the package's.

    .. versionadded:: 0.5.0
    """

    @property
    def persistent(self) -> bool:
        """Whether the tier outlives the job (then it takes every new sample, and the tiers that do not take none)."""
        ...

    def open(self, n: int, rows: int, share: int, job: int, identity: tuple[object, ...]) -> Arena:
        """This process's tier of a cache of ``n`` samples, for ``rows`` ranks: made, or adopted.

        ``share``: the caches made together that split a default capacity; ``job`` and ``identity``: what a restarted
        worker group's tier is adopted by (:mod:`~ignite_ext.data.cache.restart`; ``NO_JOB`` adopts nothing).
        """
        ...


@dataclass(frozen=True)
class RamTier:
    """The RAM tier: an arena in ``/dev/shm`` of ``capacity`` bytes (``None``: a share of the free space).

    .. versionadded:: 0.5.0
    """

    capacity: int | None

    @property
    def persistent(self) -> bool:
        """Never: RAM dies with the job."""
        return False

    def open(self, n: int, rows: int, share: int, job: int, identity: tuple[object, ...]) -> Arena:
        """See :meth:`Tier.open`."""
        return Arena.create(n, self.capacity, rows=rows, share=share, job=job, key=cache_key(*identity, "ram"))


@dataclass(frozen=True)
class DiskTier:
    """A disk tier: an arena in ``option.directory`` (see :class:`DiskOption`), kept across jobs if it persists.

    A persisted one is keyed by ``persisted`` (what names the data, with the option's ``version``) and checked with
    ``stale`` when it was there already (:mod:`~ignite_ext.data.cache.persist`).

    .. versionadded:: 0.5.0
    """

    option: DiskOption
    persisted: tuple[object, ...] = ()
    stale: Callable[[Arena], int | None] | None = None

    @property
    def persistent(self) -> bool:
        """Whether the option asks for it (``persist=True``)."""
        return self.option.persist

    def open(self, n: int, rows: int, share: int, job: int, identity: tuple[object, ...]) -> Arena:
        """See :meth:`Tier.open`."""
        disk = self.option
        network = network_filesystem(disk.directory)
        if disk.persist:
            return _persisted(n, rows, disk, network, (*self.persisted, disk.version), self.stale)
        if network is not None:
            warnings.warn(
                f"disk_dir={disk.directory!r} is on a {network} filesystem, which other hosts mount: the disk tier "
                "should be on this node's own disk (reading it costs network traffic, and its stale files can "
                "only be swept on a local disk, so they are left there). Pass a node-local directory.",
                NetworkFilesystemWarning,
                stacklevel=5,
            )
        return Arena.create(
            n,
            disk.nbytes,
            rows=rows,
            directory=disk.directory,
            share=share,
            knob="disk_bytes",
            sweep=network is None,
            job=job,
            key=cache_key(*identity, "disk", disk.directory),
        )


class Tiers:
    """The arenas of one cache, fastest first: RAM, then each further tier (a disk tier, if there is one).

    With ``persisted``, new samples go to the tiers after the first only. It pickles as its arenas' paths.

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
    .. versionchanged:: 0.5.0
       Any number of tiers.
    """

    def __init__(self, arenas: Sequence[Arena], persisted: bool = False) -> None:
        self.arenas = tuple(arenas)
        self.persisted = persisted
        # A persisted tier takes every new sample: the RAM tier, which dies with the job, takes none.
        self._stored_in = self.arenas[1:] if persisted else self.arenas

    @property
    def ram(self) -> Arena:
        """The RAM tier (``/dev/shm``)."""
        return self.arenas[0]

    @property
    def disk(self) -> Arena | None:
        """The first disk tier, or None."""
        return self.arenas[1] if len(self.arenas) > 1 else None

    def holds(self, index: int) -> bool:
        """Whether a tier holds ``index`` (nothing is copied).

        .. versionadded:: 0.4.0
        """
        return any(arena.holds(index) for arena in self.arenas)

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
        for arena in self._stored_in:
            offset = arena.reserve(index, enc.nbytes, enc.page_offset)
            if offset is None:
                if arena.holds(index):  # another process published it meanwhile
                    return None
                continue  # no room here: the next tier
            try:
                enc.write_into(arena.data_view(offset, enc.nbytes))
                before_publish(index)
            except BaseException:
                arena.abandon(offset)
                raise
            return arena if arena.publish(index, offset, enc.nbytes) else None
        return None

    def follow(self, keep: Sequence[int] | Any) -> tuple[int, int, bool]:
        """Keep only the indices of ``keep`` in every tier: ``(evicted, evicted_bytes, following)`` over the tiers.

        See :meth:`Arena.follow <ignite_ext.data.cache.arena.Arena.follow>`; ``following``: whether every tier
        follows. A persisted cache does not follow: what it holds is for the next jobs too.

        .. versionadded:: 0.4.0
        """
        import numpy as np

        if self.persisted:
            return 0, 0, False  # a persisted tier keeps what it holds for the next jobs: it never evicts
        indices = np.asarray(keep, dtype=np.int64)
        done = [arena.follow(indices) for arena in self.arenas]
        return sum(d.evicted for d in done), sum(d.evicted_bytes for d in done), all(d.following for d in done)

    def count_miss(self, row: int, slot: int, stored: Arena | None = None, nbytes: int = 0) -> None:
        """Count a miss (in the RAM tier) and, when the sample was stored, an entry of ``nbytes`` in ``stored``."""
        ram = self.ram
        if stored is ram:
            ram.count(row, slot, misses=1, entries=1, nbytes=nbytes)
            return
        ram.count(row, slot, misses=1)
        if stored is not None:
            stored.count(row, slot, entries=1, nbytes=nbytes)

    def totals(self, row: int) -> tuple[int, ...]:
        """:class:`~ignite_ext.data.cache.stats.CacheStats`' fields, in order, of ``row`` (a rank).

        The ``disk_`` fields add up every tier after the first; misses and loads ahead are counted in the first.
        """
        rows = [arena.totals(row) for arena in self.arenas]
        every = [sum(column) for column in zip(*rows, strict=True)]
        further = [sum(column) for column in zip(*rows[1:], strict=True)] if len(rows) > 1 else [0] * 7
        hits, _, entries, nbytes, evictions, evicted, _ = every
        return (hits, rows[0][1], entries, nbytes, further[0], further[2], further[3], evictions, evicted, rows[0][6])

    def close(self) -> None:
        """Close every tier (see :meth:`Arena.close <ignite_ext.data.cache.arena.Arena.close>`)."""
        for arena in self.arenas:
            arena.close()


def open_tiers(
    n: int, kinds: Sequence[Tier], rows: int = 1, share: int = 1, identity: tuple[object, ...] | None = None
) -> Tiers:
    """Open the tiers ``kinds`` of a cache of ``n`` samples, fastest first, owned by this process.

    With ``identity`` (what tells this cache from the job's others), each tier adopts the arena the attempt before of
    a restarted worker group left of the same cache, if any (:mod:`~ignite_ext.data.cache.restart`).

    Raises:
        ShmSpaceError: a tier does not fit its directory (then no file is left).

    .. versionadded:: 0.5.0
    """
    job = job_key() if identity is not None else NO_JOB
    opened: list[Arena] = []
    try:
        for kind in kinds:
            opened.append(kind.open(n, rows, share, job, identity or ()))
    except BaseException:
        for arena in opened:
            arena.close()
        raise
    return Tiers(opened, persisted=any(kind.persistent for kind in kinds))


def create_tiers(
    n: int,
    capacity: int | None,
    disk: DiskOption | None,
    rows: int = 1,
    share: int = 1,
    identity: tuple[object, ...] | None = None,
    persisted: tuple[object, ...] = (),
    stale: Callable[[Arena], int | None] | None = None,
) -> Tiers:
    """The :class:`RamTier` and, with ``disk``, a :class:`DiskTier` of a cache of ``n`` samples (:func:`open_tiers`).

    With ``disk.persist`` every sample goes to the disk tier, none to RAM.

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.3.0
       ``identity``, ``persisted`` and ``stale``.
    """
    if disk is not None and disk.persist:
        capacity = ALIGN  # the smallest: every sample goes to the persisted tier
    kinds: list[Tier] = [RamTier(capacity)]
    if disk is not None:
        kinds.append(DiskTier(disk, persisted, stale))
    return open_tiers(n, kinds, rows, share, identity)


def persisted_as(option: DiskOption) -> str:
    """How a disk option's persistence reads in a message: ``""``, ``", persisted"`` or ``", persisted as 'v2'"``.

    Examples:
        >>> from ignite_ext.data.cache.tiers import DiskOption, persisted_as
        >>> persisted_as(DiskOption("/d", None)), persisted_as(DiskOption("/d", None, True, "v2"))
        ('', ", persisted as 'v2'")

    .. versionadded:: 0.3.0
    """
    if not option.persist:
        return ""
    return ", persisted" if option.version is None else f", persisted as {option.version!r}"


def checker(dataset: Any, n: int) -> Callable[[Arena], int | None]:
    """What checks a persisted cache of ``dataset`` against it when a job opens it (a few samples, drawn anew).

    .. versionadded:: 0.3.0
    """
    return lambda arena: stale_sample(arena.lookup, dataset, n, random.randrange(1 << 30))


def _persisted(
    n: int,
    rows: int,
    disk: DiskOption,
    network: str | None,
    identity: tuple[object, ...],
    stale: Callable[[Arena], int | None] | None,
) -> Arena:
    """The persisted disk tier of ``identity``: opened and checked against the dataset, or built anew."""
    if network is not None:
        raise ValueError(
            f"persist=True needs a disk_dir on this node's own disk; {disk.directory!r} is on a {network} filesystem, "
            "which other hosts mount (a job there could not tell whether another host's job still uses a cache)"
        )
    key = persist_key(*identity)
    arena, adopted = Arena.open_persisted(disk.directory, n, rows, key, disk.nbytes)
    if arena is None:
        warnings.warn(
            f"the persisted cache's name in {disk.directory} is taken by a file that is not yours: this job's disk "
            "tier lives only as long as the job. Pass a disk_dir of your own",
            StaleCacheWarning,
            stacklevel=6,  # the user's construction: _persisted, DiskTier.open, open_tiers, create_tiers, __init__
        )
        return Arena.create(n, disk.nbytes, rows=rows, directory=disk.directory, knob="disk_bytes")
    if adopted and stale is not None and (index := stale(arena)) is not None:
        warnings.warn(
            f"the persisted cache {arena.path} holds a sample {index} that differs from the dataset's now: it is "
            "rebuilt. The cache's identity (name, length, first, middle and last samples, version=) did not change: "
            "pass a new version= when the data changes",
            StaleCacheWarning,
            stacklevel=6,  # the user's construction: _persisted, DiskTier.open, open_tiers, create_tiers, __init__
        )
        arena.discard()
        return _persisted(n, rows, disk, network, identity, None)  # built anew: nothing to check
    return arena


class _Setup(NamedTuple):
    """What one rank brings to a node cache's construction; the ranks of each node must bring the same."""

    node: int
    local_rank: int
    length: int
    name: str
    given: bool  # name= was given: it stands for the construction site too
    site: str
    samples: str  # sample_fingerprint, or "" on a node of one rank (nothing to pair)
    disk_dir: str | None  # with ", persisted" or ", persisted as <version>" when it outlives the job
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
    persist: bool = False,
    version: str | None = None,
) -> tuple[Tiers, str, DiskOption | None]:
    """Create the node's tiers on its local rank 0 and attach them on the other ranks of the node (collective).

    The ranks of each node must agree on the length, the name, the construction site (unless ``name`` is given),
    the sample fingerprint (:mod:`~ignite_ext.data.cache.identity`) and the ``disk_dir``, or every rank raises.
    Returns the tiers, this rank's name and its disk option.

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.3.0
       The construction site and the sample fingerprint must agree too.
    """
    import ignite.distributed as idist

    from ignite_ext.distributed import agree
    from ignite_ext.distributed.agreement import disagreement

    node, local_rank = idist.get_node_rank(), idist.get_local_rank()
    # Outside the agreed step: every rank counts this construction, so the next one at this line still pairs.
    site = construction_site()
    created: list[Tiers] = []
    disk: list[DiskOption | None] = []

    def setup() -> _Setup:
        mine = checked_name(dataset, name)
        disk.append(disk_option(disk_dir, disk_bytes, persist, version))
        # Inside the agreed step: a sample that fails to load fails the construction on every rank.
        samples = sample_fingerprint(dataset) if idist.get_nproc_per_node() > 1 or persist else ""
        if local_rank == 0:
            identity = ("node", mine, "" if name is not None else site, samples)
            tiers = create_tiers(
                n,
                capacity,
                disk[0],
                rows=idist.get_nproc_per_node(),
                identity=identity,
                persisted=("node", mine, n, samples),
                stale=checker(dataset, n),
            )
            created.append(tiers)
        paths = tuple(a.path for a in created[0].arenas) if created else ()
        directory = None if disk[0] is None else disk[0].directory + persisted_as(disk[0])
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
                "shared by the node's ranks; pass the same directory (or None), persist and version on every rank "
                "of the node"
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
    persisted = disk[0] is not None and disk[0].persist
    return Tiers([Arena.attach(path) for path in paths], persisted), own.name, disk[0]
