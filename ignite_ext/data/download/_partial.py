"""A writer's private temp file, and how a later writer takes over (or cleans up) what a dead one left.

Each writer writes ``root/.<name>.<host>.<pid>.<random>.tmp``, a name no one else writes, created with mode ``0o666``
so the umask decides the published file's mode. It records which URL and version (strong ``ETag`` or
``Last-Modified``) its bytes belong to in ``<temp>.json``. When it gives up it parks its bytes as
``root/.<name>.<key>.part`` (``<key>`` hashes the first URL) with that JSON next to them. The next fetch of the same
target *claims* a parked file, or the temp file of a writer that died, by renaming it to its own private name: the
rename succeeds for exactly one claimer, so two writers never share a file even without the lock. The same scan
deletes what dead writers left behind: temp files of pids that no longer exist on this host, and those of other
hosts (or parked files of other URLs) untouched for :data:`ORPHAN_MAX_AGE_S`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ignite_ext._fs import (
    OWNER,
    idle,
    listdir,
    orphans,
    own_regular_file,
    owner_tag,
    read_json,
    sidecar_stem,
    unlink,
    write_json,
)
from ignite_ext.data.download._http import Validator
from ignite_ext.data.download._verify import CHUNK, hashers

__all__ = ["ORPHAN_MAX_AGE_S", "Observer", "Partial", "Segment", "claim", "meta_path", "park", "parked_path"]

logger = logging.getLogger("ignite_ext.data.download")

#: Temp files of writers on other hosts (whose pids cannot be checked) are orphans after this many idle seconds.
ORPHAN_MAX_AGE_S = 24 * 3600.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class Segment:
    """Bytes ``start:stop`` of the file; ``done`` of them written so far (one connection of a parallel fetch).

    Defined with the temp file, which records how far each segment got, rather than with the parallel fetch that
    plans them: the fetch writes into the temp file, so the temp file cannot depend on the fetch.
    """

    start: int
    stop: int
    done: int = 0

    @property
    def complete(self) -> bool:
        """Whether every byte of the segment is written."""
        return self.start + self.done >= self.stop


def parked_path(target: Path, first_url: str) -> Path:
    key = hashlib.sha256(first_url.encode()).hexdigest()[:16]
    return target.with_name(f".{sidecar_stem(target.name)}.{key}.part")


def meta_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".json")


class Observer(Protocol):
    """Told of each byte a :class:`Partial` keeps: a relay serving the file as it grows (see ``_relay_server``)."""

    def source(self, total: int, etag: str | None, last_modified: str | None, fd: int, size: int) -> None:
        """The bytes are of this version of ``total`` bytes; ``size`` of them are in ``fd`` already."""

    def grew(self, prefix: int) -> None:
        """The first ``prefix`` bytes are in the file."""

    def restart(self) -> None:
        """The bytes start over."""


class Partial:
    """One writer's private temp file: its bytes, where they came from, and their running digests."""

    def __init__(self, path: Path, algorithms: set[str], label: str) -> None:
        self.path = path
        self.label = label
        self.algorithms = algorithms | {"sha256"}
        self.url: str | None = None
        self.validator: Validator | None = None
        #: The file's size as the response these bytes came from gave it, if it did.
        self.total: int | None = None
        # True when the bytes came from more than one response: a digest mismatch may then be the splice's fault.
        self.resumed = False
        #: Set when the server's range replies cannot be trusted: fetch whole bodies only, park nothing.
        self.no_resume = False
        #: Set when the bytes must not be kept for a later call (e.g. the disk filled up while writing them).
        self.discard = False
        #: ``[start, stop, done]`` of each segment of a parallel fetch in progress (beyond ``size`` is not held).
        self.segments: list[list[int]] | None = None
        #: The length each strong ``ETag`` of each URL was given, by this call's responses or the bytes' record.
        self.lengths: dict[tuple[str, str], int] = {}
        #: Told of the bytes as they are kept (a relay serving them to the job's other holders), if any.
        self.observer: Observer | None = None
        # Never through a link: the path is private, but a shared folder's other users could have put one there.
        self.fd = os.open(path, os.O_RDWR | _NOFOLLOW | getattr(os, "O_BINARY", 0))
        self._hashers = hashers(self.algorithms)
        # Bytes taken over from an earlier writer count towards the digests like any other.
        while chunk := os.read(self.fd, CHUNK):
            self._update(chunk)
        self.size = os.lseek(self.fd, 0, os.SEEK_END)

    @property
    def meta(self) -> Path:
        return meta_path(self.path)

    def restart(self) -> None:
        if self.observer is not None:
            self.observer.restart()  # before the bytes go: a relay stops serving them first
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.size = 0
        self.resumed = False
        self._hashers = hashers(self.algorithms)
        self.segments = None

    def append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self._update(data)
        self.size += len(data)
        if self.observer is not None:
            self.observer.grew(self.size)

    def _update(self, data: bytes) -> None:
        for hasher in self._hashers.values():
            hasher.update(data)

    def digests(self) -> dict[str, str]:
        return {name: hasher.hexdigest() for name, hasher in self._hashers.items()}

    def note_source(self, url: str, validator: Validator, total: int | None) -> None:
        """Record, next to the bytes, which URL and version they belong to (what a later resume needs)."""
        self.url, self.validator, self.total = url, validator, total
        self._record()
        if self.observer is not None and total is not None:
            self.observer.source(total, validator.etag, validator.last_modified, self.fd, self.size)

    def note_length(self, url: str, validator: Validator, total: int | None) -> None:
        """Remember the length a response gave this strong ``ETag`` of ``url`` (the first one given stays)."""
        if validator.etag is not None and total is not None:
            self.lengths.setdefault((url, validator.etag), total)

    def lengths_of(self, url: str) -> dict[str, int]:
        """The length each strong ``ETag`` of ``url`` was given so far."""
        return {etag: total for (each, etag), total in self.lengths.items() if each == url}

    def note_segments(self, segments: Sequence[Segment] | None) -> None:
        """Record how far each segment of a parallel fetch got (a later writer keeps only the complete prefix)."""
        self.segments = None if segments is None else [[s.start, s.stop, s.done] for s in segments]
        self._record()

    def absorb(self, start: int, stop: int) -> None:
        """Take bytes ``start:stop``, written in place by other connections, into the size and the digests."""
        assert start == self.size, (start, self.size)
        offset = start
        while offset < stop:
            chunk = os.pread(self.fd, min(CHUNK, stop - offset), offset)
            if not chunk:
                raise OSError(errno.EIO, f"the temp file ends at byte {offset} of {stop}", str(self.path))
            self._update(chunk)
            offset += len(chunk)
        self.size = stop
        os.lseek(self.fd, stop, os.SEEK_SET)
        self.note_segments(None)
        if self.observer is not None:
            self.observer.grew(self.size)

    def _record(self) -> None:
        if self.url is None or self.validator is None:
            return
        validator = self.validator
        record = {
            "url": self.url,
            "etag": validator.etag,
            "last_modified": validator.last_modified,
            "total": self.total,
            "segments": self.segments,
        }
        with contextlib.suppress(OSError):
            write_json(self.meta, {**record, "inode": os.fstat(self.fd).st_ino})

    def sync_and_close(self) -> os.stat_result:
        """Flush the bytes to stable storage and close; the stat identifies the file once published.

        Raises:
            OSError: the private path no longer names these bytes (another user replaced it): nothing to publish.
        """
        os.fsync(self.fd)
        st = os.fstat(self.fd)
        self.close()
        try:
            here = os.lstat(self.path)
        except FileNotFoundError:
            here = None
        if here is None or (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(here.st_mode):
            raise OSError(errno.EEXIST, "the private temp file was replaced by another process", str(self.path))
        return st

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim(target: Path, urls: Sequence[str], algorithms: set[str]) -> Partial:
    """Take over the bytes a previous writer left for this target, or start a new private file.

    Also deletes what gone writers left that cannot be resumed here.
    """
    parked = parked_path(target, urls[0])
    stem = re.escape(sidecar_stem(target.name))
    temps = re.compile(rf"\.{stem}\.{OWNER}\.tmp")
    others = re.compile(rf"\.{stem}\.(?P<key>[0-9a-f]{{16}})\.part")
    candidates = [path for path, _ in orphans(target.parent, temps, ORPHAN_MAX_AGE_S)]
    if parked.exists():
        candidates.append(parked)
    candidates.sort(key=_size, reverse=True)
    mine = target.with_name(f".{sidecar_stem(target.name)}.{owner_tag()}.tmp")
    partial = None
    for candidate in candidates:
        if partial is None:
            partial = _adopt(candidate, mine, urls, algorithms, target.name)
        unlink(candidate, meta_path(candidate))
    for name in listdir(target.parent):
        path = target.parent / name
        if path != parked and others.fullmatch(name) and idle(path, ORPHAN_MAX_AGE_S):
            unlink(path, meta_path(path))
    _remove_stray_records(target, temps)
    return partial or Partial(_create(mine), algorithms, target.name)


def _remove_stray_records(target: Path, temps: re.Pattern[str]) -> None:
    """Delete the JSON records of temp files that are gone, and half-written records of gone writers."""
    records = re.compile(rf"(?:{temps.pattern})\.json")
    for path, _ in orphans(target.parent, records, ORPHAN_MAX_AGE_S):
        if not path.with_suffix("").exists():
            unlink(path)
    writes = re.compile(rf"\.{re.escape(sidecar_stem(target.name))}\.[^/]*\.json\.{OWNER}\.tmp")
    for path, _ in orphans(target.parent, writes, ORPHAN_MAX_AGE_S):
        unlink(path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _create(path: Path) -> Path:
    # 0o666 and no chmod: the umask decides, as for any other file the job writes (not 0600 like mkstemp).
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return path


def _adopt(candidate: Path, mine: Path, urls: Sequence[str], algorithms: set[str], label: str) -> Partial | None:
    # Only this user's own regular files are taken over: in a group-writable folder another user can plant a
    # symlink (to a file of ours) under a predictable name, with a record that points us at it.
    if not (own_regular_file(candidate) and own_regular_file(meta_path(candidate))):
        return None
    record = read_json(meta_path(candidate))
    if record is None or record.get("url") not in urls:
        return None
    validator = Validator(etag=record.get("etag"), last_modified=record.get("last_modified"))
    if validator.if_range is None:
        return None
    try:
        # The rename is the claim: it succeeds for one caller only, lock or no lock.
        os.rename(candidate, mine)
    except FileNotFoundError:
        return None
    try:
        _keep_prefix(mine, record.get("segments"))
        partial = Partial(mine, algorithms, label)  # O_NOFOLLOW: a link swapped in after the check is refused
    except OSError:
        unlink(mine)
        return None
    st = os.fstat(partial.fd)
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        partial.close()
        unlink(mine)
        return None
    os.utime(partial.fd if os.utime in os.supports_fd else mine)  # fresh mtime: not an idle orphan for other hosts
    if st.st_ino != record.get("inode"):
        # The record belongs to other bytes (a concurrent park replaced one of the two files): start over.
        partial.restart()
        return partial
    logger.info("resuming %s from byte %d", candidate.name, partial.size)
    partial.resumed = partial.size > 0
    total = record.get("total")
    total = total if isinstance(total, int) else None
    partial.note_source(record["url"], validator, total)
    partial.note_length(record["url"], validator, total)
    return partial


def held_prefix(segments: object) -> int | None:
    """The bytes a parallel fetch's record proves held: up to the first segment not complete (None: no segments).

    Examples:
        >>> from ignite_ext.data.download._partial import held_prefix
        >>> held_prefix([[100, 200, 100], [200, 300, 40], [300, 400, 100]])  # the third is complete, not adjacent
        240
        >>> held_prefix(None) is None
        True
    """
    if not isinstance(segments, list) or not segments:
        return None
    held = None
    for item in sorted(segments):
        start, stop, done = (int(v) for v in item)
        if held is not None and start != held:
            break
        held = start + min(max(done, 0), stop - start)
        if held < stop:
            break
    return held


def _keep_prefix(path: Path, segments: object) -> None:
    """Cut an adopted temp file of a parallel fetch back to the bytes its record proves (its holes are zeros)."""
    held = held_prefix(segments)
    if held is None:
        return
    fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    try:
        if os.fstat(fd).st_size > held:
            os.ftruncate(fd, held)
    finally:
        os.close(fd)


def park(partial: Partial, target: Path, first_url: str) -> None:
    """Leave resumable bytes under the target's parked name; drop bytes that could not be resumed."""
    resumable = partial.validator is not None and partial.validator.if_range is not None
    if partial.size > 0 and partial.url is not None and resumable and not (partial.discard or partial.no_resume):
        parked = parked_path(target, first_url)
        with contextlib.suppress(OSError):
            os.replace(partial.path, parked)
            os.replace(partial.meta, meta_path(parked))
            return
    unlink(partial.path, partial.meta)
