"""SharedPath: one rank per *physically* shared directory runs first.

Whether two ranks share a directory is a property of the filesystem, not of path strings or hostnames:
``/tmp/data`` on two nodes is two directories, ``/scratch/data`` on NFS is one for the whole cluster, and a
symlink or bind mount makes two strings one directory. ``st_dev``/``st_ino`` do not compare across hosts, and
``flock`` is a no-op on some NFS, Lustre and GPFS mounts. So the ranks take a census on the filesystem itself:

1. every rank creates its directory (if missing) and a marker file with a fresh random name in it;
2. the marker names are exchanged (one collective), and every rank looks up every other rank's marker *by
   exact name* — a name nobody has looked up before, so no client holds a cached negative entry for it, and
   no directory listing (which NFS may serve stale for ``acdirmax`` seconds) is involved;
3. the visibility table is exchanged (a second collective); ranks that see each other's markers form a group;
4. every rank removes its own marker, also when any step failed on any rank.

The lowest rank of each group leads: the leaders run the block first, in parallel, then every other rank of
each group runs it after its leader.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from ignite_ext.distributed.policies import Comm, Plan, Policy, Turn, World

__all__ = ["MARKER_PREFIX", "SharedPath", "census_groups"]

#: Marker files of a census in progress start with this; they live a few milliseconds.
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
        """Take the census and make each group's lowest rank its leader."""
        directory = Path(os.fspath(self.path)).expanduser().absolute()
        marker: list[Path] = []
        try:
            names = comm.agree(lambda: self._mark(directory, marker), f"preparing SharedPath({str(directory)!r})")
            visible = comm.agree(
                lambda: [r for r, name in enumerate(names) if (directory / name).exists()],
                f"taking the SharedPath census in {str(directory)!r}",
            )
        finally:
            for m in marker:
                m.unlink(missing_ok=True)
        turns: dict[int, Turn] = {}
        for group in census_groups(visible):
            leader = group[0]
            for r in group:
                turns[r] = Turn(r, r == leader, frozenset() if r == leader else frozenset({leader}), group, leader)
        return Plan(tuple(turns[r] for r in range(world.world_size)))

    @staticmethod
    def _mark(directory: Path, created: list[Path]) -> str:
        directory.mkdir(parents=True, exist_ok=True)
        if not directory.is_dir():
            raise NotADirectoryError(f"{directory} is not a directory")
        name = f"{MARKER_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
        path = directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        created.append(path)
        os.close(fd)
        return name
