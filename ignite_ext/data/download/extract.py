"""Safe, atomic archive extraction: :func:`extract_archive`.

``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz`` and ``.zip`` archives are checked member by member
before anything is written: absolute paths, ``..``, links (symbolic or hard) that resolve outside the target
(chains of links included), members written through a link, device files and fifos, and a total size above a
bound are all refused with :class:`ArchiveError`. Tar archives are then extracted with ``filter="data"``
(PEP 706) on top, and every link in the result is checked once more against the real filesystem.

Extraction goes into a private sibling directory ``.<dest>.<host>.<pid>.<random>.extracting`` that receives a
completion record and is then renamed to ``dest``: ``dest`` is either complete or absent, a second call is a
no-op, and concurrent callers wait for each other on a file lock (which, as for downloads, only saves work). When
the disk fails the extraction (full, as under an archive bomb, or over quota), the private directory is removed
and :class:`~ignite_ext.errors.DownloadError` (an :class:`OSError` with the failure's ``errno``) is raised.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ignite_ext._fs import OWNER, fsync_dir, orphans, owner_tag, read_json, sidecar_stem
from ignite_ext._locks import exclusive
from ignite_ext.data.download._members import UNREADABLE, check_links, extract_tar, extract_zip
from ignite_ext.data.download._partial import ORPHAN_MAX_AGE_S
from ignite_ext.errors import ArchiveError, DownloadError, IgniteExtError

__all__ = ["DEFAULT_MAX_TOTAL_BYTES", "ArchiveError", "archive_stem", "extract_archive"]

logger = logging.getLogger("ignite_ext.data.extract")

#: Default bound on the total uncompressed size of an archive's files: 1 TiB.
DEFAULT_MAX_TOTAL_BYTES = 1 << 40
_SUFFIXES = {".tar.gz": "tar", ".tgz": "tar", ".tar.bz2": "tar", ".tar.xz": "tar", ".tar": "tar", ".zip": "zip"}
# Written into the directory before it is renamed into place, so that it arrives with the files.
_RECORD = ".ignite_ext-extracted.json"


def archive_stem(name: str) -> str:
    """Strip a supported archive suffix from a file name: where ``download_url(..., extract=True)`` extracts to.

    Args:
        name: a file name such as ``"data.tar.gz"``.

    Returns:
        The name without its archive suffix.

    Raises:
        ArchiveError: the name has no supported archive suffix.

    Examples:
        >>> from ignite_ext.data.download import archive_stem
        >>> archive_stem("cifar-10-python.tar.gz"), archive_stem("glue.zip")
        ('cifar-10-python', 'glue')

    .. versionadded:: 0.1.0
    """
    return name[: -len(_suffix(name))]


def extract_archive(
    archive: str | os.PathLike[str], dest_dir: str | os.PathLike[str], *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
) -> Path:
    """Extract ``archive`` into ``dest_dir`` safely and atomically, once.

    ``dest_dir`` is created by a rename: afterwards it holds the complete archive, before it does not exist. If it
    already holds this archive (same name, size and modification time, per the record the extraction leaves in
    it), nothing is done; if it holds an earlier extraction of another version, it is replaced. A directory that
    some other program made is never touched.

    Args:
        archive: a ``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz`` or ``.zip`` file.
        dest_dir: the directory to create; its parent is created if missing.
        max_total_bytes: refuse archives whose files add up to more than this many bytes.

    Returns:
        ``dest_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ArchiveError: an unsafe member (absolute path, ``..``, a link leaving ``dest_dir``, a member inside a
            link, a device or fifo), a total size above ``max_total_bytes``, or an unsupported suffix.
        DownloadError: the disk failed the extraction (full, over quota, an I/O error): an :class:`OSError` with
            the ``errno`` of the failure; what was extracted so far is removed. Or another user's process held the
            extraction lock for :data:`~ignite_ext._locks.PATIENCE_S` seconds (the message names it).
        FileExistsError: ``dest_dir`` exists, is not empty and was not made by this function.

    Examples:
        >>> import io, tarfile, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data import extract_archive
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     archive = Path(tmp, "hello.tar.gz")
        ...     with tarfile.open(archive, "w:gz") as tar:
        ...         info = tarfile.TarInfo("hello.txt")
        ...         info.size = 5
        ...         tar.addfile(info, io.BytesIO(b"hello"))
        ...     out = extract_archive(archive, Path(tmp, "hello"))
        ...     print(out.name, (out / "hello.txt").read_text())
        hello hello

    .. versionadded:: 0.1.0
    """
    source = Path(archive)
    dest = Path(dest_dir)
    kind = _SUFFIXES[_suffix(source.name)]
    identity = _identity(source)
    if _state(dest, identity) == "complete":
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(
        dest.with_name(f".{sidecar_stem(dest.name)}.extract.lock"), f"another process's extraction into {dest}", logger
    ):
        if _state(dest, identity) != "complete":
            _remove_orphans(dest)
            _extract_atomically(source, kind, dest, identity, max_total_bytes)
    return dest


def _suffix(name: str) -> str:
    lower = name.lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[len(name) - len(suffix) :]
    raise ArchiveError(f"{name}: not a supported archive ({', '.join(_SUFFIXES)})")


def _identity(archive: Path) -> dict[str, Any]:
    st = archive.stat()
    return {"archive": archive.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _state(dest: Path, identity: Mapping[str, Any]) -> str:
    """``complete`` (this archive), ``stale`` (ours, another archive), ``absent`` (or empty); else raise."""
    if not dest.exists() and not dest.is_symlink():
        return "absent"
    if dest.is_dir() and not dest.is_symlink():
        record = read_json(dest / _RECORD)
        if record is not None:
            return "complete" if record == dict(identity) else "stale"
        if not any(dest.iterdir()):
            return "absent"
    raise FileExistsError(errno.EEXIST, "exists and was not made by extract_archive; not touching it", str(dest))


def _remove_orphans(dest: Path) -> None:
    pattern = re.compile(rf"\.{re.escape(sidecar_stem(dest.name))}\.{OWNER}\.(?:extracting|old)")
    for path, _ in orphans(dest.parent, pattern, ORPHAN_MAX_AGE_S):
        shutil.rmtree(path, ignore_errors=True)


def _extract_atomically(
    archive: Path, kind: str, dest: Path, identity: Mapping[str, Any], max_total_bytes: int
) -> None:
    temp = dest.with_name(f".{sidecar_stem(dest.name)}.{owner_tag()}.extracting")
    with _disk_errors(archive, temp, dest):
        temp.mkdir()
    try:
        with _disk_errors(archive, temp, dest):
            logger.info("extracting %s into %s", archive, dest)
            _extract_checked(archive, kind, temp, max_total_bytes)
            check_links(temp)
            (temp / _RECORD).write_text(json.dumps(dict(identity), sort_keys=True), encoding="utf-8")
        _publish(temp, dest, identity)
    finally:
        shutil.rmtree(temp, ignore_errors=True)  # also what a bomb wrote before the disk filled up


@contextlib.contextmanager
def _disk_errors(archive: Path, temp: Path, dest: Path) -> Iterator[None]:
    """Raise the disk's failures of an extraction (ENOSPC, EDQUOT, EIO...) as the package's error.

    :class:`DownloadError` is the package's :class:`OSError`, and it keeps the failure's ``errno``: callers that
    catch ``OSError`` (or test ``errno``) around an extraction keep doing so. It names the archive and the
    destination, not the private directory.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno is None or isinstance(exc, IgniteExtError):
            raise
        shown = str(exc).replace(str(temp), f"<{dest}>")
        error = DownloadError(
            f"extracting {archive.name} into {dest}: {shown}; nothing was kept (the partial extraction is removed)"
        )
        error.errno = exc.errno
        raise error from exc


def _extract_checked(archive: Path, kind: str, dest: Path, max_total_bytes: int) -> None:
    try:
        if kind == "tar":
            extract_tar(archive, dest, max_total_bytes)
        else:
            extract_zip(archive, dest, max_total_bytes)
    except UNREADABLE as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # the disk, not the archive (gzip and bz2 report corrupt streams as OSError without errno)
        refused = isinstance(exc, getattr(tarfile, "FilterError", ()))  # PEP 706, Python 3.11.4+
        what = "refused by tarfile's data filter" if refused else "unreadable archive"
        raise ArchiveError(f"{archive.name}: {what}: {exc}") from exc


def _publish(temp: Path, dest: Path, identity: Mapping[str, Any]) -> None:
    """Rename ``temp`` to ``dest``; replace a stale ``dest`` by moving it aside first (absent, never half)."""
    while True:
        try:
            os.rename(temp, dest)
            break
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        # Only reached without a working lock: another caller may have published meanwhile.
        if _state(dest, identity) == "complete":
            return
        old = dest.with_name(f".{sidecar_stem(dest.name)}.{owner_tag()}.old")
        with contextlib.suppress(FileNotFoundError):
            os.rename(dest, old)
            shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dest.parent)
