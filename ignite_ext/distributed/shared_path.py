"""SharedPath: one rank per *physically* shared directory runs first.

Whether two ranks share a directory is a property of the filesystem, not of path strings or hostnames:
``/tmp/data`` on two nodes is two directories, ``/scratch/data`` on NFS is one for the whole cluster, and a
symlink or bind mount makes two strings one directory. ``st_dev``/``st_ino`` do not compare across hosts, and
``flock`` is a no-op on some NFS, Lustre and GPFS mounts. So the census works in two steps, each one small gather
and O(1) filesystem operations per rank:

1. *Within a host.* Every rank creates its directory (if missing) and sends a digest of (host, ``st_dev``,
   ``st_ino``) of it, where the host is the hostname, the boot id and the mount namespace (so that containers on
   one kernel are told apart). Ranks with the same digest share the directory; the lowest of them is its host
   leader.
2. *Across hosts.* Every host leader writes a private file with its rank in the directory and hard-links it to
   one name fresh for this census: the link succeeds for exactly one leader per *physical* directory (an atomic
   server-side operation on NFS, close-to-open consistent), and the others read the winner's rank from the name
   that already exists. No directory listing (which NFS may serve stale), no lock. Where the filesystem has no
   hard links, an exclusive create of the name does the same.

Groups are the ranks whose host leaders found the same winner; the lowest rank of each group leads: the leaders run
the block first, in parallel, then every other rank of each group after its leader. The files live a few
milliseconds and are removed by their writers, also when any step failed on any rank. Cost per rank: two gathers
of O(1) bytes each, two filesystem operations (a host leader: about six).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import time
import uuid
from pathlib import Path

import ignite.distributed as idist

from ignite_ext.distributed.policies import Comm, Plan, Policy, Turn, World

__all__ = ["MARKER_PREFIX", "SharedPath", "census_groups"]

#: Files of a census in progress start with this; they live a few milliseconds.
MARKER_PREFIX = ".ignite_ext-census-"


def census_groups(visible: list[list[int]]) -> list[tuple[int, ...]]:
    """Group ranks by the census table: ``visible[r]`` lists the ranks whose markers rank ``r`` saw.

    Visibility is taken as symmetric (either direction joins two ranks), so a one-sided glitch of a
    filesystem cache can only merge groups, which costs a wait, never split one, which would cost a race.

    Args:
        visible: for each rank, the ranks whose markers it found (itself included or not).

    Returns:
        The groups, each sorted, ordered by their lowest rank.

    Examples:
        >>> from ignite_ext.distributed.shared_path import census_groups
        >>> census_groups([[0, 2], [1], [0, 2], [3, 1]])
        [(0, 2), (1, 3)]

    .. versionadded:: 0.1.0
    """
    parent = list(range(len(visible)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for r, seen in enumerate(visible):
        for other in seen:
            a, b = root(r), root(other)
            parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for r in range(len(visible)):
        groups.setdefault(root(r), []).append(r)
    return [tuple(g) for _, g in sorted(groups.items())]


class SharedPath(Policy):
    """One rank per physically shared directory runs first (e.g. downloads), then the others of that directory.

    Ranks may pass different strings (``/data`` here, a symlink to it there); they are grouped by the directory
    the strings resolve to on the filesystem, found by a census of marker files (see the module docstring), so
    a node-local path gives one leader per node and an NFS path one leader for the whole cluster. The
    directory is created if missing. The yielded :class:`~ignite_ext.distributed.Turn` is truthy on leaders and
    tells every rank its ``group`` (the ranks sharing its directory) and ``leader``.

    A directory that is unusable on any rank (not a directory, read-only, no permission) raises ``ValueError``
    on every rank before anyone runs the block.

    Args:
        path: this rank's directory (``str`` or path-like); may differ between ranks.

    Examples:
        >>> import tempfile
        >>> import ignite_ext.distributed as idist
        >>> with tempfile.TemporaryDirectory() as root:
        ...     with idist.rank_scheduler(order=idist.SharedPath(root)) as turn:
        ...         print(bool(turn), turn.group, turn.leader)
        True (0,) 0

    .. versionadded:: 0.1.0
    """

    collective = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"SharedPath({os.fspath(self.path)!r})" if isinstance(self.path, str | os.PathLike) else "SharedPath"

    def describe(self) -> str:
        """Return ``"SharedPath"``: ranks may pass different paths, so the path is not compared."""
        return "SharedPath"

    def validate(self, world: World) -> None:
        """Check that ``path`` is a ``str`` or path-like object."""
        if not isinstance(self.path, str | os.PathLike) or not os.fspath(self.path):
            raise ValueError(f"path should be a non-empty str or os.PathLike, but given {self.path!r}")

    def plan(self, world: World, comm: Comm) -> Plan:
        """Take the census (see the module docstring) and make each group's lowest rank its leader."""
        directory = Path(os.fspath(self.path)).expanduser().absolute()
        made: list[Path] = []
        try:
            local = comm.agree(lambda: _local_key(directory), f"preparing SharedPath({str(directory)!r})")
            keys = [key for key, _ in local]
            nonce = local[0][1]  # rank 0's: a name nobody has used, so no client holds a cached entry for it
            host_leader = {key: keys.index(key) for key in keys}
            me = idist.get_rank()
            leading = host_leader[keys[me]] == me
            winners = comm.agree(
                lambda: _rendezvous(directory, nonce, me, made) if leading else None,
                f"taking the SharedPath census in {str(directory)!r}",
            )
        finally:
            for path in made:
                path.unlink(missing_ok=True)
        roots = [winners[host_leader[key]] for key in keys]  # every host leader reported a winner
        assert all(root is not None for root in roots), roots
        turns: dict[int, Turn] = {}
        by_root: dict[int | None, list[int]] = {}
        for r, root in enumerate(roots):
            by_root.setdefault(root, []).append(r)
        for group in sorted(tuple(g) for g in by_root.values()):
            leader = group[0]
            for r in group:
                turns[r] = Turn(r, r == leader, frozenset() if r == leader else frozenset({leader}), group, leader)
        return Plan(tuple(turns[r] for r in range(world.world_size)))


def _host_identity() -> str:
    """This host as a directory's ``st_dev``/``st_ino`` are valid on it: hostname, boot id, mount namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        mounts = str(os.stat("/proc/self/ns/mnt").st_ino)
    except OSError:
        mounts = ""
    return f"{socket.gethostname()}|{boot}|{mounts}"


def _local_key(directory: Path) -> tuple[str, str]:
    """(digest of this host and the directory's identity on it, a fresh random token)."""
    directory.mkdir(parents=True, exist_ok=True)
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory")
    st = directory.stat()
    key = hashlib.sha256(f"{_host_identity()}|{st.st_dev}|{st.st_ino}".encode()).hexdigest()[:24]
    return key, uuid.uuid4().hex


def _rendezvous(directory: Path, nonce: str, rank: int, made: list[Path]) -> int:
    """Claim this census's name in ``directory`` for ``rank``; return the rank that holds it (the winner)."""
    common = directory / f"{MARKER_PREFIX}{nonce}"
    mine = directory / f"{MARKER_PREFIX}{nonce}.{rank}.{uuid.uuid4().hex[:8]}"
    fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    made.append(mine)
    try:
        os.write(fd, str(rank).encode())
    finally:
        os.close(fd)
    try:
        os.link(mine, common)  # atomic: the name appears with the content, for exactly one leader
    except FileExistsError:
        return _read_winner(common)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        return _create_exclusively(common, rank, made)
    made.append(common)
    return rank


def _create_exclusively(common: Path, rank: int, made: list[Path]) -> int:
    """The same claim without hard links: an exclusive create, then the rank written (losers may see it empty)."""
    try:
        fd = os.open(common, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return _read_winner(common)
    made.append(common)
    try:
        os.write(fd, str(rank).encode())
    finally:
        os.close(fd)
    return rank


def _read_winner(common: Path) -> int:
    # With hard links the content arrives with the name; after an exclusive create it may lag a moment behind it.
    deadline = time.monotonic() + 10.0
    while True:
        text = common.read_text().strip()
        if text:
            return int(text)
        if time.monotonic() > deadline:
            raise OSError(errno.EIO, f"the SharedPath census file {common} stayed empty")
        time.sleep(0.01)
