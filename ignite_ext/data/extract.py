"""Safe, atomic archive extraction: :func:`extract_archive`.

``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz`` and ``.zip`` archives are checked member by member
before anything is written: absolute paths, ``..``, links (symbolic or hard) that resolve outside the target
(chains of links included), members written through a link, device files and fifos, and a total size above a
bound are all refused with :class:`ArchiveError`. Tar archives are then extracted with ``filter="data"``
(PEP 706) on top, and every link in the result is checked once more against the real filesystem.

Extraction goes into a private sibling directory ``.<dest>.<host>.<pid>.<random>.extracting`` that receives a
completion record and is then renamed to ``dest``: ``dest`` is either complete or absent, a second call is a
no-op, and concurrent callers wait for each other on a file lock (which, as for downloads, only saves work).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import lzma
import os
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ignite_ext.data.download import _OWNER, _exclusive, _fsync_dir, _orphans, _owner_tag, _read_json

__all__ = ["DEFAULT_MAX_TOTAL_BYTES", "ArchiveError", "archive_stem", "extract_archive"]

logger = logging.getLogger("ignite_ext.data.extract")

#: Default bound on the total uncompressed size of an archive's files: 1 TiB.
DEFAULT_MAX_TOTAL_BYTES = 1 << 40
_SUFFIXES = {".tar.gz": "tar", ".tgz": "tar", ".tar.bz2": "tar", ".tar.xz": "tar", ".tar": "tar", ".zip": "zip"}
# Written into the directory before it is renamed into place, so that it arrives with the files.
_RECORD = ".ignite_ext-extracted.json"
_MAX_LINK_HOPS = 40
_CHUNK = 1 << 20
# What a truncated or corrupt archive raises from the standard library's readers and decompressors.
_UNREADABLE = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError)


class ArchiveError(ValueError):
    """An archive is unsafe to extract, too large, or not of a supported type; nothing was extracted.

    Examples:
        >>> from ignite_ext.data import ArchiveError
        >>> issubclass(ArchiveError, ValueError)
        True

    .. versionadded:: 0.1.0
    """


def archive_stem(name: str) -> str:
    """Strip a supported archive suffix from a file name: where ``download_url(..., extract=True)`` extracts to.

    Args:
        name: a file name such as ``"data.tar.gz"``.

    Returns:
        The name without its archive suffix.

    Raises:
        ArchiveError: the name has no supported archive suffix.

    Examples:
        >>> from ignite_ext.data.extract import archive_stem
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
    with _exclusive(dest.with_name(f".{dest.name}.extract.lock"), f"another process's extraction into {dest}"):
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
        record = _read_json(dest / _RECORD)
        if record is not None:
            return "complete" if record == dict(identity) else "stale"
        if not any(dest.iterdir()):
            return "absent"
    raise FileExistsError(errno.EEXIST, "exists and was not made by extract_archive; not touching it", str(dest))


def _remove_orphans(dest: Path) -> None:
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.{_OWNER}\.(?:extracting|old)")
    for path, _ in _orphans(dest.parent, pattern):
        shutil.rmtree(path, ignore_errors=True)


def _extract_atomically(
    archive: Path, kind: str, dest: Path, identity: Mapping[str, Any], max_total_bytes: int
) -> None:
    temp = dest.with_name(f".{dest.name}.{_owner_tag()}.extracting")
    temp.mkdir()
    try:
        logger.info("extracting %s into %s", archive, dest)
        _extract_checked(archive, kind, temp, max_total_bytes)
        _check_links(temp)
        (temp / _RECORD).write_text(json.dumps(dict(identity), sort_keys=True), encoding="utf-8")
        _publish(temp, dest, identity)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _extract_checked(archive: Path, kind: str, dest: Path, max_total_bytes: int) -> None:
    try:
        if kind == "tar":
            _extract_tar(archive, dest, max_total_bytes)
        else:
            _extract_zip(archive, dest, max_total_bytes)
    except _UNREADABLE as exc:
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
        old = dest.with_name(f".{dest.name}.{_owner_tag()}.old")
        with contextlib.suppress(FileNotFoundError):
            os.rename(dest, old)
            shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(dest.parent)


# --- member checks ----------------------------------------------------------------------------------------------


def _parts(name: str, what: str = "member") -> list[str]:
    """The path components of an archive name, refusing anything that could leave the target."""
    if not name or "\0" in name or name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        raise ArchiveError(f"{what} {name!r}: absolute or empty path")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"{what} {name!r}: '..' in path")
    return parts


def _resolve(parts: list[str], links: Mapping[str, str], name: str) -> list[str]:
    """Resolve ``parts`` inside the archive, following its symbolic links; refuse any step outside the root."""
    todo = deque(parts)
    out: list[str] = []
    hops = 0
    while todo:
        part = todo.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                raise ArchiveError(f"link {name!r} points outside the target")
            out.pop()
            continue
        out.append(part)
        target = links.get("/".join(out))
        if target is None:
            continue
        hops += 1
        if hops > _MAX_LINK_HOPS or target.startswith("/"):
            raise ArchiveError(f"link {name!r} points outside the target or loops")
        out.pop()
        todo.extendleft(reversed(target.split("/")))
    return out


def _check_tar_members(members: list[tarfile.TarInfo], max_total_bytes: int) -> None:
    links = {"/".join(_parts(m.name)): m.linkname for m in members if m.issym()}
    files = {"/".join(_parts(m.name)) for m in members if m.isfile()}
    total = 0
    for member in members:
        parts = _parts(member.name)
        if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
            raise ArchiveError(f"member {member.name!r}: device files and fifos are not extracted")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise ArchiveError(f"member {member.name!r}: unsupported type {member.type!r}")
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise ArchiveError(f"member {member.name!r} lies inside a link")
        if member.issym():
            if not member.linkname or member.linkname.startswith("/"):
                raise ArchiveError(f"link {member.name!r} -> {member.linkname!r} points outside the target")
            _resolve([*parts[:-1], *member.linkname.split("/")], links, member.name)
        if member.islnk() and "/".join(_resolve(_parts(member.linkname, "link"), links, member.name)) not in files:
            raise ArchiveError(f"hard link {member.name!r} -> {member.linkname!r} is not a file of the archive")
        total += member.size if member.isfile() else 0
        if total > max_total_bytes:
            raise ArchiveError(f"archive holds more than {max_total_bytes} bytes")


def _extract_tar(archive: Path, dest: Path, max_total_bytes: int) -> None:
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        _check_tar_members(members, max_total_bytes)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python without PEP 706: the checks above are all there is
            tar.extractall(dest, members=members)


def _extract_zip(archive: Path, dest: Path, max_total_bytes: int) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        total = 0
        for info in infos:
            _parts(info.filename)
            kind = stat.S_IFMT(info.external_attr >> 16)
            if kind == stat.S_IFLNK:
                raise ArchiveError(f"member {info.filename!r}: links are not extracted from zip archives")
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise ArchiveError(f"member {info.filename!r}: device files and fifos are not extracted")
            total += info.file_size
            if total > max_total_bytes:
                raise ArchiveError(f"archive holds more than {max_total_bytes} bytes")
        budget = [max_total_bytes]
        for info in infos:
            _extract_zip_member(zf, info, dest, budget)


def _extract_zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, budget: list[int]) -> None:
    path = dest.joinpath(*_parts(info.filename))
    if info.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as src, open(path, "wb") as out:
        while chunk := src.read(_CHUNK):
            # Declared sizes can lie; the bound holds for the bytes actually written.
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise ArchiveError(f"{info.filename!r}: archive holds more bytes than it declares")
            out.write(chunk)


def _check_links(root: Path) -> None:
    """Every link of the extracted tree must resolve inside it (on the real filesystem, after extraction)."""
    real_root = os.path.realpath(root)
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            if os.path.islink(path) and os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
                raise ArchiveError(f"{os.path.relpath(path, root)!r} points outside the target")
