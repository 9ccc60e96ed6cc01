"""The directory of a cache's disk tier: the checks of ``disk_dir``, and whether it is on a network filesystem.

The disk tier belongs on the node's own disk: elsewhere it gains nothing but network traffic, and the sweep, which
judges a creator dead by its pid *on this host* and a ``flock`` that is node-local on GPFS or NFS ``nolock``, could
delete another host's live cache. So a directory on a network filesystem gets a :class:`NetworkFilesystemWarning`
and is never swept. The check is a heuristic: the filesystem type of the mount whose device (``major:minor`` in
``/proc/self/mountinfo``) is the directory's ``st_dev``, looked up in :data:`NETWORK_FILESYSTEMS`; a filesystem it
does not know, or a device it does not find (some btrfs subvolumes), counts as local.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import os

from ignite_ext.errors import IgniteExtError

__all__ = ["MOUNTINFO", "NETWORK_FILESYSTEMS", "NetworkFilesystemWarning", "check_disk_dir", "network_filesystem"]

#: Where this process's mounts are listed, with their devices and filesystem types.
MOUNTINFO = "/proc/self/mountinfo"
# fmt: off
#: Filesystem types (as ``/proc/self/mountinfo`` names them) that other hosts mount too.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs", "afs", "panfs", "wekafs",
    "gfs2", "ocfs2", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph-fuse", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs",
    "fuse.rclone",
})
# fmt: on


class NetworkFilesystemWarning(IgniteExtError, UserWarning):
    """A cache's ``disk_dir`` is on a filesystem that other hosts mount: it gains nothing and is not swept.

    Give the disk tier a directory on the node's own disk (often ``/tmp``, ``/local`` or ``/scratch/local``).

    .. versionadded:: 0.2.0
    """


def check_disk_dir(disk_dir: str | os.PathLike[str]) -> str:
    """``disk_dir`` resolved (``os.path.realpath``), once it is known to be a directory this user can fill.

    Raises:
        ValueError: it is not a path, does not exist, is not a directory, cannot be written and searched by this
            user, or is on a read-only filesystem.

    Examples:
        >>> import os, tempfile
        >>> from ignite_ext.data.cache.disk import check_disk_dir
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     check_disk_dir(directory) == os.path.realpath(directory)
        True
        >>> check_disk_dir("/nonexistent/cache")
        Traceback (most recent call last):
        ...
        ValueError: disk_dir='/nonexistent/cache' does not exist

    .. versionadded:: 0.2.0
    """
    if not isinstance(disk_dir, str | os.PathLike) or not os.fspath(disk_dir):
        raise ValueError(f"disk_dir must be the path of a directory, got {disk_dir!r}")
    path = os.fspath(disk_dir)
    real = os.path.realpath(path)
    if not os.path.lexists(real):
        raise ValueError(f"disk_dir={path!r} does not exist")
    if not os.path.isdir(real):
        raise ValueError(f"disk_dir={path!r} is not a directory")
    if not os.access(real, os.W_OK | os.X_OK):
        raise ValueError(f"disk_dir={path!r} is not writable by this user (uid {os.geteuid()})")
    if os.statvfs(real).f_flag & os.ST_RDONLY:
        raise ValueError(f"disk_dir={path!r} is on a read-only filesystem")
    return real


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on, from :data:`MOUNTINFO`; None if no mount has its device.

    Examples:
        >>> from ignite_ext.data.cache.disk import filesystem_type
        >>> filesystem_type("/proc")
        'proc'
    """
    dev = os.stat(path).st_dev
    device = f"{os.major(dev)}:{os.minor(dev)}"
    found = None
    try:
        with open(MOUNTINFO) as mounts:
            for line in mounts:
                # "<id> <parent> <major:minor> <root> <mount point> <options> [optional...] - <type> <source> ..."
                fields, _, rest = line.partition(" - ")
                if fields.split()[2:3] == [device] and rest.split():
                    found = rest.split()[0]  # the last one: a later mount of the device shadows the earlier
    except OSError:
        return None
    return found


def network_filesystem(path: str) -> str | None:
    """The filesystem type of ``path`` if it is one of :data:`NETWORK_FILESYSTEMS`, else None.

    Examples:
        >>> from ignite_ext.data.cache.disk import network_filesystem
        >>> network_filesystem("/proc") is None
        True

    .. versionadded:: 0.2.0
    """
    kind = filesystem_type(path)
    return kind if kind in NETWORK_FILESYSTEMS else None
