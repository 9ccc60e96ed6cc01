"""Member checks of tar and zip archives, and their extraction into a private directory.

Every member is checked before anything is written: absolute paths, ``..``, links (symbolic or hard) that resolve
outside the target (chains of links included), members written through a link, device files and fifos, and a total
size above a bound are all refused with :class:`~ignite_ext.errors.ArchiveError`. Tar archives are then extracted
with ``filter="data"`` (PEP 706) on top, and every link in the result is checked once more against the real
filesystem (:func:`check_links`).
"""

from __future__ import annotations

import lzma
import os
import re
import stat
import tarfile
import zipfile
import zlib
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from ignite_ext.errors import ArchiveError

__all__ = ["UNREADABLE", "check_links", "extract_tar", "extract_zip"]

_MAX_LINK_HOPS = 40
_CHUNK = 1 << 20
#: What a truncated or corrupt archive raises from the standard library's readers and decompressors.
UNREADABLE = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError)


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


def extract_tar(archive: Path, dest: Path, max_total_bytes: int) -> None:
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        _check_tar_members(members, max_total_bytes)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python without PEP 706: the checks above are all there is
            tar.extractall(dest, members=members)


def extract_zip(archive: Path, dest: Path, max_total_bytes: int) -> None:
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


def check_links(root: Path) -> None:
    """Every link of the extracted tree must resolve inside it (on the real filesystem, after extraction)."""
    real_root = os.path.realpath(root)
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            if os.path.islink(path) and os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
                raise ArchiveError(f"{os.path.relpath(path, root)!r} points outside the target")
