"""Member checks of tar and zip archives, and their extraction into a private directory.

The checks follow the archive **in extraction order**, against the tree as it stands after each member (what
``tarfile`` will actually have written by then), not against the last definition of each name:

* names: no absolute paths, no ``..``, no NUL, at most :data:`MAX_DEPTH` components and :data:`MAX_NAME_BYTES`
  bytes (deeper trees cost quadratic time in the standard library and end in ``RecursionError``);
* nothing is written through a link: a member whose parent is, or once was, a symbolic link is refused, and so is
  any member whose name is or was a link (a link is never redefined, and never replaced by a file or directory);
* a name never changes kind (a file is not redefined as a directory, nor the reverse), and no member is written
  under a file;
* symbolic links resolve inside the target, through the links that exist when they are written (a later link can
  still change where an earlier one leads, but never makes anything be written through it; the final check of
  every link on the real filesystem refuses a result that points outside);
* hard links point to a regular file of the archive written before them, reached through no link;
* device files and fifos are refused, and the total size is bounded (declared sizes, then the bytes written).

Extraction itself does not trust the platform either: files and directories get this process's owner (never the
archive's uid/gid, even as root) and their mode loses setuid, setgid, sticky and group/other write bits, whether or
not this Python has ``tarfile.data_filter`` (PEP 706, 3.11.4+); where it does, it runs as well. Every link of the
result is checked once more against the real filesystem (:func:`check_links`).
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ignite_ext import progress
from ignite_ext.errors import ArchiveError

__all__ = [
    "MAX_DEPTH",
    "MAX_NAME_BYTES",
    "UNREADABLE",
    "check_links",
    "check_tar_members",
    "extract_tar",
    "extract_zip",
]

#: Most path components a member name may have.
MAX_DEPTH = 256
#: Longest member name, in bytes of UTF-8 (Linux's ``PATH_MAX``).
MAX_NAME_BYTES = 4096
_MAX_LINK_HOPS = 40
_CHUNK = 1 << 20
#: What a truncated or corrupt archive raises from the standard library's readers and decompressors.
UNREADABLE = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError)
# Mode bits an extracted file or directory may keep: no setuid/setgid/sticky, no group or other write.
_MODE_MASK = 0o755


def _parts(name: str, what: str = "member") -> list[str]:
    """The path components of an archive name, refusing anything that could leave the target."""
    if not name or "\0" in name or name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        raise ArchiveError(f"{what} {name!r}: absolute or empty path")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise ArchiveError(f"{what} {name[:80]!r}...: name longer than {MAX_NAME_BYTES} bytes")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"{what} {name!r}: '..' in path")
    if len(parts) > MAX_DEPTH:
        raise ArchiveError(f"{what} {name[:80]!r}...: deeper than {MAX_DEPTH} components")
    return parts


def _prefixes(parts: list[str]) -> Iterable[str]:
    """``a``, ``a/b``, ... of ``a/b/c``: the directories a member is written through (linear in the name)."""
    prefix = ""
    for part in parts[:-1]:
        prefix = f"{prefix}/{part}" if prefix else part
        yield prefix


class _Tree:
    """The tree as extraction leaves it after each member: what each name is, and where its links lead."""

    def __init__(self) -> None:
        self.kinds: dict[str, str] = {}  # name -> "dir", "file" or "link"
        self.links: dict[str, str] = {}  # name -> link target, for symbolic links
        self.ever_links: set[str] = set()

    def resolve(self, parts: list[str], name: str) -> list[str]:
        """Resolve ``parts`` through the links of the tree so far; refuse any step outside the root."""
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
            target = self.links.get("/".join(out))
            if target is None:
                continue
            hops += 1
            if hops > _MAX_LINK_HOPS or target.startswith("/"):
                raise ArchiveError(f"link {name!r} points outside the target or loops")
            out.pop()
            todo.extendleft(reversed(target.split("/")))
        return out

    def add(self, member: tarfile.TarInfo) -> None:
        parts = _parts(member.name)
        path = "/".join(parts)
        for prefix in _prefixes(parts):
            if prefix in self.ever_links:
                raise ArchiveError(f"member {member.name!r} lies inside a link")
            if self.kinds.get(prefix, "dir") != "dir":
                raise ArchiveError(f"member {member.name!r} lies inside the file {prefix!r}")
            self.kinds[prefix] = "dir"
        kind = "dir" if member.isdir() else "link" if member.issym() else "file"
        if not path:
            if kind != "dir":
                raise ArchiveError(f"member {member.name!r}: the target itself can only be a directory")
            return
        before = self.kinds.get(path)
        if path in self.ever_links or (kind == "link" and before is not None):
            raise ArchiveError(f"member {member.name!r} redefines a link, or replaces an earlier member by one")
        if before is not None and before != kind:
            raise ArchiveError(f"member {member.name!r} is a {kind} but an earlier member made it a {before}")
        if kind == "link":
            if not member.linkname or member.linkname.startswith("/"):
                raise ArchiveError(f"link {member.name!r} -> {member.linkname!r} points outside the target")
            self.links[path] = member.linkname  # first: a link through itself is a loop
            self.ever_links.add(path)
            self.resolve([*parts[:-1], *member.linkname.split("/")], member.name)
        elif member.islnk():
            target = _parts(member.linkname, "link")
            if any(p in self.ever_links for p in (*_prefixes(target), "/".join(target))):
                raise ArchiveError(f"hard link {member.name!r} -> {member.linkname!r} goes through a link")
            if self.kinds.get("/".join(target)) != "file":
                raise ArchiveError(
                    f"hard link {member.name!r} -> {member.linkname!r} is not a file of the archive written before it"
                )
        self.kinds[path] = kind


def check_tar_members(members: list[tarfile.TarInfo], max_total_bytes: int) -> None:
    """Refuse the archive unless every member is safe in extraction order (see the module docstring).

    Raises:
        ArchiveError: the first unsafe member, or the total size above ``max_total_bytes``.
    """
    tree = _Tree()
    total = 0
    for member in members:
        if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
            raise ArchiveError(f"member {member.name!r}: device files and fifos are not extracted")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise ArchiveError(f"member {member.name!r}: unsupported type {member.type!r}")
        tree.add(member)
        total += member.size if member.isfile() else 0
        if total > max_total_bytes:
            raise ArchiveError(f"archive holds more than {max_total_bytes} bytes")


def _safe_mode(mode: int, is_dir: bool) -> int:
    return (mode & _MODE_MASK) | (0o700 if is_dir else 0o600)


class _OwnTarFile(tarfile.TarFile):
    """Extracts with this process's owner and without privileged mode bits, on every Python."""

    def chown(self, tarinfo: tarfile.TarInfo, targetpath: str, numeric_owner: bool) -> None:  # type: ignore[override]
        """Keep the extracting process's owner: an archive must not hand files to other users."""

    def chmod(self, tarinfo: tarfile.TarInfo, targetpath: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> None:
        """Apply the member's mode without setuid, setgid, sticky and group/other write bits."""
        if tarinfo.issym() or tarinfo.mode is None:  # the data filter leaves None for "keep the default"
            return
        os.chmod(targetpath, _safe_mode(tarinfo.mode, tarinfo.isdir()))


def extract_tar(archive: Path, dest: Path, max_total_bytes: int) -> None:
    """Check, then extract a tar archive into ``dest`` (a fresh, private directory)."""
    with _OwnTarFile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        check_tar_members(members, max_total_bytes)
        options: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        # Members reported as they are extracted: the ranks waiting for this one see how far it got.
        tar.extractall(dest, members=progress.track(members, what=f"extracting {archive.name}"), **options)


def extract_zip(archive: Path, dest: Path, max_total_bytes: int) -> None:
    """Check, then extract a zip archive into ``dest`` (a fresh, private directory)."""
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        total = 0
        kinds: dict[str, str] = {}
        for info in infos:
            parts = _parts(info.filename)
            if not parts:
                raise ArchiveError(f"member {info.filename!r}: names the target itself")
            kind = stat.S_IFMT(info.external_attr >> 16)
            if kind == stat.S_IFLNK:
                raise ArchiveError(f"member {info.filename!r}: links are not extracted from zip archives")
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise ArchiveError(f"member {info.filename!r}: device files and fifos are not extracted")
            if info.flag_bits & 0x1:
                raise ArchiveError(f"member {info.filename!r} is encrypted: encrypted zip archives are not supported")
            for prefix in _prefixes(parts):
                if kinds.setdefault(prefix, "dir") != "dir":
                    raise ArchiveError(f"member {info.filename!r} lies inside the file {prefix!r}")
            mine = "dir" if info.is_dir() else "file"
            if kinds.setdefault("/".join(parts), mine) != mine:
                raise ArchiveError(f"member {info.filename!r} is a {mine} but an earlier member made it a directory")
            total += info.file_size
            if total > max_total_bytes:
                raise ArchiveError(f"archive holds more than {max_total_bytes} bytes")
        budget = [max_total_bytes]
        for info in progress.track(infos, what=f"extracting {archive.name}"):
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
