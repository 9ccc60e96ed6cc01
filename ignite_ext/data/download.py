"""Race-free, resumable, verified downloads: :func:`download_url`.

How one file gets from a URL to ``root/filename``, whatever else runs at the same time:

* **Lock, only to save work.** Callers for the same target take an exclusive ``flock`` on ``root/.<name>.lock``
  (:class:`filelock.FileLock`); one fetches, the others wait and then find the verified file. The kernel drops a
  ``flock`` when its holder dies, so a killed process never leaves a lock that blocks the next call. Nothing
  below depends on the lock: where ``flock`` silently succeeds for everyone (some NFS, Lustre and GPFS mounts)
  several callers fetch, and every one of them still publishes a complete, verified file.
* **Private temp files, atomic publish.** Each writer writes ``root/.<name>.<host>.<pid>.<random>.tmp``, a name
  no one else writes, created with mode ``0o666`` so the umask decides the published file's mode. It is
  fsynced, its digests checked, renamed over the target with :func:`os.replace` and the directory fsynced. The
  final path holds either nothing, the previous file or the new verified file, never a partial one.
* **Resume.** A writer records which URL and version (strong ``ETag`` or ``Last-Modified``) its bytes belong
  to in ``<temp>.json``. When it gives up it parks its bytes as ``root/.<name>.<key>.part`` (``<key>`` hashes
  the first URL) with that JSON next to them. The next fetch of the same target *claims* a parked file, or the
  temp file of a writer that died (its pid is gone on this host), by renaming it to its own private name;
  the rename succeeds for exactly one claimer, so two writers never share a file even without the lock. It
  then asks for the rest with ``Range`` and ``If-Range``: a 206 continues the file, a 200 (no range support, or
  the file changed upstream) starts over.
* **Cleanup.** The same scan deletes what dead writers left behind: temp files of pids that no longer exist on
  this host, and those of other hosts (or parked files of other URLs) untouched for :data:`ORPHAN_MAX_AGE_S`.
* **Verification cache.** The digests of the published file are kept in ``root/.<name>.verified.json`` with its
  size, ``mtime_ns`` and inode; a later call with a checksum compares against that record and only hashes the
  file again when it changed.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import filelock
from tqdm.auto import tqdm

from ignite_ext.data._http import (
    FatalHTTPError,
    RetryableError,
    Validator,
    backoff_delay,
    check_scheme,
    open_range,
)
from ignite_ext.data._proc import pid_alive

__all__ = [
    "ORPHAN_MAX_AGE_S",
    "ChecksumError",
    "DownloadError",
    "add_cli_arguments",
    "cli",
    "download_url",
]

logger = logging.getLogger("ignite_ext.data.download")

#: Temp files of writers on other hosts (whose pids cannot be checked) are orphans after this many idle seconds.
ORPHAN_MAX_AGE_S = 24 * 3600.0
_CHUNK = 1 << 20
_POLL_S = 0.01
_DIGEST_LENGTHS = {"sha256": 64, "md5": 32}
# host.pid.random: whoever made a temp name, so that the scan can tell whether that writer is still alive.
_OWNER = r"(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]{8})"


class DownloadError(OSError):
    """A download failed: the server refused (404 and other 4xx), or every attempt on every URL failed.

    It is an :class:`OSError`, like the :class:`urllib.error.URLError` it often wraps, so code that already
    catches I/O errors around a download keeps working.

    Args:
        message: one line naming the URL(s) and what went wrong.
        url: the URL of the last failure, if one.
        status: the HTTP status of the last failure, if one.

    Examples:
        >>> from ignite_ext.data import DownloadError
        >>> err = DownloadError("https://example.org/x.bin: HTTP 404 Not Found", status=404)
        >>> isinstance(err, OSError), err.status
        (True, 404)

    .. versionadded:: 0.1.0
    """

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status


class ChecksumError(DownloadError):
    """The downloaded bytes do not have the expected digest; nothing was published.

    Args:
        message: one line naming the URL, the algorithm, the expected and the actual digest.
        algorithm: ``"sha256"`` or ``"md5"``.
        expected: the digest that was asked for.
        actual: the digest of what was received.
        url: where the bytes came from.

    Examples:
        >>> from ignite_ext.data import ChecksumError, DownloadError
        >>> err = ChecksumError("x: sha256 mismatch", algorithm="sha256", expected="ab", actual="cd")
        >>> isinstance(err, DownloadError), err.expected, err.actual
        (True, 'ab', 'cd')

    .. versionadded:: 0.1.0
    """

    def __init__(
        self, message: str, *, algorithm: str = "", expected: str = "", actual: str = "", url: str | None = None
    ) -> None:
        super().__init__(message, url=url)
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual


class _Lock(Protocol):
    def acquire(self, timeout: float | None = None, poll_interval: float = ...) -> object: ...

    def release(self) -> None: ...


def _file_lock(path: str) -> _Lock:
    try:
        # A soft lock (a file that exists while held) outlives a SIGKILL; rather no lock than one that blocks.
        return filelock.FileLock(path, is_singleton=True, fallback_to_soft=False)
    except TypeError:  # filelock < 4 has no soft fallback to turn off
        return filelock.FileLock(path, is_singleton=True)


# Replaced in tests by a lock that never excludes anyone, to check that correctness does not rest on it.
_lock_factory: Callable[[str], _Lock] = _file_lock


def download_url(
    url: str,
    root: str | os.PathLike[str],
    filename: str | None = None,
    *,
    sha256: str | None = None,
    md5: str | None = None,
    mirrors: Sequence[str] = (),
    extract: bool = False,
    timeout: float = 30.0,
    retries: int = 3,
    progress: bool = True,
) -> Path:
    """Download ``url`` to ``root/filename`` once per filesystem, verified, atomically and resumably.

    Safe to call from every rank of a job, from several jobs, or from plain processes at once: one caller
    fetches while the others wait on a file lock, and all of them return the same verified file. An existing
    file is returned as is when no checksum is given, and fetched again when it does not match the one given;
    digests are remembered, so a verified file is not hashed again on every call. See the module docstring for
    the files involved, and the downloads guide for the guarantees.

    Args:
        url: ``http``, ``https`` or ``file`` URL.
        root: directory to download into; created if missing.
        filename: name of the file in ``root``; by default the last segment of the URL's path.
        sha256: expected SHA-256 of the file, in hex.
        md5: expected MD5 of the file, in hex (as torchvision's ``download_url`` takes it).
        mirrors: further URLs of the same file, tried in order when ``url`` fails.
        extract: extract the archive with :func:`~ignite_ext.data.extract_archive` into ``root/<stem>``, where
            ``<stem>`` is the file name without its archive suffix (``data.tar.gz`` → ``root/data``), and
            return that directory.
        timeout: seconds to wait for a connection or for the next bytes of the body.
        retries: further attempts per URL after connection errors, timeouts, short bodies, 5xx and 429, with
            exponential backoff (a short ``Retry-After`` is honoured); each attempt resumes where the last
            stopped when the server allows it.
        progress: show a progress bar (only the process that fetches shows one).

    Returns:
        The path of the file, or with ``extract=True`` of the directory it was extracted into.

    Raises:
        ValueError: a URL scheme other than ``http``, ``https`` and ``file``, a malformed digest or filename.
        ChecksumError: every source served bytes with another digest than expected.
        DownloadError: a 404 or other 4xx (no retry), or all attempts on all URLs failed.
        ArchiveError: with ``extract=True``, an unsafe or oversized archive.

    Examples:
        >>> import hashlib, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data import download_url
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     source = Path(tmp, "hello.txt")
        ...     _ = source.write_bytes(b"hello")
        ...     digest = hashlib.sha256(b"hello").hexdigest()
        ...     path = download_url(source.as_uri(), Path(tmp, "data"), sha256=digest, progress=False)
        ...     print(path.name, path.read_bytes())
        hello.txt b'hello'

    .. versionadded:: 0.1.0
    """
    urls = [url, *mirrors]
    for each in urls:
        check_scheme(each)
    if retries < 0 or not timeout > 0:
        raise ValueError(f"need retries >= 0 and timeout > 0, got retries={retries}, timeout={timeout}")
    expected = _expected_digests(sha256=sha256, md5=md5)
    root_dir = Path(root).expanduser()
    root_dir.mkdir(parents=True, exist_ok=True)
    target = root_dir / _target_name(url, filename)
    if not _is_valid(target, expected):
        with _exclusive(_lock_path(target), f"another process's download of {target}"):
            # Whoever held the lock before us may have just published it.
            if not _is_valid(target, expected):
                _fetch(target, urls, expected, timeout=timeout, retries=retries, progress=progress)
    if not extract:
        return target
    from ignite_ext.data.extract import archive_stem, extract_archive

    return extract_archive(target, root_dir / archive_stem(target.name))


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``python -m ignite_ext download`` to ``parser``.

    Args:
        parser: the (sub)parser of the ``download`` command.

    Examples:
        >>> import argparse
        >>> from ignite_ext.data.download import add_cli_arguments
        >>> parser = argparse.ArgumentParser()
        >>> add_cli_arguments(parser)
        >>> args = parser.parse_args(["https://example.org/a.tgz", "--root", "data", "--extract"])
        >>> args.url, args.root, args.extract, args.progress
        ('https://example.org/a.tgz', 'data', True, True)

    .. versionadded:: 0.1.0
    """
    parser.add_argument("url", help="http, https or file URL")
    parser.add_argument("--root", required=True, help="directory to download into")
    parser.add_argument("--filename", help="file name in ROOT (default: from the URL)")
    parser.add_argument("--sha256", help="expected SHA-256, hex")
    parser.add_argument("--md5", help="expected MD5, hex")
    parser.add_argument("--mirror", action="append", default=[], dest="mirrors", help="another URL (repeatable)")
    parser.add_argument("--extract", action="store_true", help="extract the archive into ROOT/<stem>")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds (default: 30)")
    parser.add_argument("--retries", type=int, default=3, help="further attempts per URL (default: 3)")
    parser.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar")


def cli(args: argparse.Namespace) -> int:
    """Run ``python -m ignite_ext download``: print the resulting path, or one error line on stderr.

    Args:
        args: parsed by a parser set up with :func:`add_cli_arguments`.

    Returns:
        0 on success, 1 on failure.

    Examples:
        >>> import argparse, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data.download import add_cli_arguments, cli
        >>> parser = argparse.ArgumentParser()
        >>> add_cli_arguments(parser)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     source = Path(tmp, "a.txt")
        ...     _ = source.write_text("a")
        ...     status = cli(parser.parse_args([source.as_uri(), "--root", tmp + "/out", "--no-progress"]))
        ...     print(status, Path(tmp, "out", "a.txt").read_text())  # doctest: +ELLIPSIS
        /.../out/a.txt
        0 a

    .. versionadded:: 0.1.0
    """
    try:
        path = download_url(
            args.url,
            args.root,
            args.filename,
            sha256=args.sha256,
            md5=args.md5,
            mirrors=args.mirrors,
            extract=args.extract,
            timeout=args.timeout,
            retries=args.retries,
            progress=args.progress,
        )
    except (OSError, ValueError) as exc:  # ArchiveError is a ValueError
        message = " ".join(str(exc).split())
        print(f"error: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1
    print(path)
    return 0


# --- names and checks -----------------------------------------------------------------------------------------


def _target_name(url: str, filename: str | None) -> str:
    name = filename if filename is not None else Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ValueError(f"cannot use {name!r} as a file name for {url!r}; pass a plain filename=")
    return name


def _expected_digests(**given: str | None) -> dict[str, str]:
    expected = {}
    for algorithm, value in given.items():
        if value is None:
            continue
        digest = value.strip().lower()
        if len(digest) != _DIGEST_LENGTHS[algorithm] or not re.fullmatch(r"[0-9a-f]+", digest):
            raise ValueError(f"{algorithm} must be {_DIGEST_LENGTHS[algorithm]} hex digits, got {value!r}")
        expected[algorithm] = digest
    return expected


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _verified_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.verified.json")


def _parked_path(target: Path, first_url: str) -> Path:
    key = hashlib.sha256(first_url.encode()).hexdigest()[:16]
    return target.with_name(f".{target.name}.{key}.part")


def _meta_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".json")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"


def _owner_tag() -> str:
    """``host.pid.random``: unique to this writer, and tells a later scan whether the writer still lives."""
    return f"{_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def _owner_gone(match: re.Match[str], path: Path) -> bool:
    """Whether the writer named in ``match`` can no longer touch ``path``."""
    # On Windows os.kill(pid, 0) would send CTRL_C_EVENT, so only the idle-age rule applies there.
    if match["host"] == _host() and os.name != "nt":
        return not pid_alive(int(match["pid"]))
    return _idle(path)


def _idle(path: Path) -> bool:
    """Untouched for :data:`ORPHAN_MAX_AGE_S`: the only sign of death for a writer on another host."""
    try:
        return time.time() - path.stat().st_mtime > ORPHAN_MAX_AGE_S
    except FileNotFoundError:
        return False


def _orphans(directory: Path, pattern: re.Pattern[str]) -> Iterator[tuple[Path, re.Match[str]]]:
    """Entries of ``directory`` named like ``pattern`` whose writer is gone."""
    for name in _listdir(directory):
        match = pattern.fullmatch(name)
        if match is not None and _owner_gone(match, directory / name):
            yield directory / name, match


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically (readers see the old or the new record, never a torn one)."""
    temp = path.with_name(f"{path.name}.{_owner_tag()}.tmp")
    try:
        temp.write_text(json.dumps(value, sort_keys=True), encoding="utf-8")
        os.replace(temp, path)
    finally:
        _unlink(temp)


# --- the lock ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive(lock_path: Path, waiting_for: str) -> Iterator[None]:
    """Hold the lock on ``lock_path`` if the filesystem allows; log once when it has to wait."""
    lock = _lock_factory(str(lock_path))
    held = False
    try:
        if not _acquire_now(lock):
            logger.info("waiting for %s", waiting_for)
            # Every waiter re-checks the file under the lock in turn; short polls keep that queue from adding up.
            lock.acquire(poll_interval=_POLL_S)
        held = True
    except (OSError, NotImplementedError) as exc:
        # Correctness does not rest on the lock, so a filesystem that cannot lock costs duplicates, not errors.
        logger.warning("cannot lock %s (%s); going on without: duplicate work is possible", lock_path, exc)
    try:
        yield
    finally:
        if held:
            lock.release()


def _acquire_now(lock: _Lock) -> bool:
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return False
    return True


# --- verification ---------------------------------------------------------------------------------------------


def _hashers(algorithms: Iterable[str]) -> dict[str, Any]:
    # Integrity checks, not security: MD5 must stay usable on FIPS-restricted builds too.
    return {name: hashlib.new(name, usedforsecurity=False) for name in algorithms}


def _hash_file(path: Path, algorithms: Iterable[str]) -> dict[str, str]:
    hashers = _hashers(algorithms)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for hasher in hashers.values():
                hasher.update(chunk)
    return {name: hasher.hexdigest() for name, hasher in hashers.items()}


def _file_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _remember_digests(target: Path, st: os.stat_result, digests: Mapping[str, str]) -> None:
    with contextlib.suppress(OSError):  # a read-only dataset directory just means hashing again next time
        _write_json(_verified_path(target), {**_file_key(st), "digests": dict(digests)})


def _digests_of(target: Path, st: os.stat_result, algorithms: set[str]) -> dict[str, str]:
    """The digests of ``target``, from the record if it still describes the file, else by hashing it."""
    record = _read_json(_verified_path(target))
    if record is not None and all(record.get(k) == v for k, v in _file_key(st).items()):
        known = record.get("digests")
        if isinstance(known, dict) and algorithms <= known.keys():
            return known
    digests = _hash_file(target, algorithms | {"sha256"})
    _remember_digests(target, st, digests)
    return digests


def _mismatch(expected: Mapping[str, str], actual: Mapping[str, str]) -> tuple[str, str, str] | None:
    for algorithm, digest in expected.items():
        if actual[algorithm] != digest:
            return algorithm, digest, actual[algorithm]
    return None


def _is_valid(target: Path, expected: Mapping[str, str]) -> bool:
    """Whether ``target`` exists and has the expected digests (any existing file when none are expected)."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    if not expected:
        return True
    wrong = _mismatch(expected, _digests_of(target, st, set(expected)))
    if wrong is not None:
        logger.warning("%s has %s %s, expected %s; fetching it again", target, wrong[0], wrong[2], wrong[1])
    return wrong is None


# --- the writer's private file --------------------------------------------------------------------------------


class _Partial:
    """One writer's private temp file: its bytes, where they came from, and their running digests."""

    def __init__(self, path: Path, algorithms: set[str], label: str) -> None:
        self.path = path
        self.label = label
        self.algorithms = algorithms | {"sha256"}
        self.url: str | None = None
        self.validator: Validator | None = None
        # True when the bytes came from more than one response: a digest mismatch may then be the splice's fault.
        self.resumed = False
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o666)
        self._hashers = _hashers(self.algorithms)
        # Bytes taken over from an earlier writer count towards the digests like any other.
        while chunk := os.read(self.fd, _CHUNK):
            self._update(chunk)
        self.size = os.lseek(self.fd, 0, os.SEEK_END)

    @property
    def meta(self) -> Path:
        return _meta_path(self.path)

    def restart(self) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.size = 0
        self.resumed = False
        self._hashers = _hashers(self.algorithms)

    def append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self._update(data)
        self.size += len(data)

    def _update(self, data: bytes) -> None:
        for hasher in self._hashers.values():
            hasher.update(data)

    def digests(self) -> dict[str, str]:
        return {name: hasher.hexdigest() for name, hasher in self._hashers.items()}

    def note_source(self, url: str, validator: Validator) -> None:
        """Record, next to the bytes, which URL and version they belong to (what a later resume needs)."""
        self.url, self.validator = url, validator
        record = {"url": url, "etag": validator.etag, "last_modified": validator.last_modified}
        with contextlib.suppress(OSError):
            _write_json(self.meta, {**record, "inode": os.fstat(self.fd).st_ino})

    def sync_and_close(self) -> os.stat_result:
        """Flush the bytes to stable storage and close; the stat identifies the file once published."""
        os.fsync(self.fd)
        st = os.fstat(self.fd)
        self.close()
        return st

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _claim(target: Path, urls: Sequence[str], algorithms: set[str]) -> _Partial:
    """Take over the bytes a previous writer left for this target, or start a new private file.

    Also deletes what gone writers left that cannot be resumed here.
    """
    parked = _parked_path(target, urls[0])
    temps = re.compile(rf"\.{re.escape(target.name)}\.{_OWNER}\.tmp")
    others = re.compile(rf"\.{re.escape(target.name)}\.(?P<key>[0-9a-f]{{16}})\.part")
    candidates = [path for path, _ in _orphans(target.parent, temps)]
    if parked.exists():
        candidates.append(parked)
    candidates.sort(key=_size, reverse=True)
    mine = target.with_name(f".{target.name}.{_owner_tag()}.tmp")
    partial = None
    for candidate in candidates:
        if partial is None:
            partial = _adopt(candidate, mine, urls, algorithms, target.name)
        _unlink(candidate, _meta_path(candidate))
    for name in _listdir(target.parent):
        path = target.parent / name
        if path != parked and others.fullmatch(name) and _idle(path):
            _unlink(path, _meta_path(path))
    _remove_stray_records(target, temps)
    return partial or _Partial(_create(mine), algorithms, target.name)


def _remove_stray_records(target: Path, temps: re.Pattern[str]) -> None:
    """Delete the JSON records of temp files that are gone, and half-written records of gone writers."""
    records = re.compile(rf"(?:{temps.pattern})\.json")
    for path, _ in _orphans(target.parent, records):
        if not path.with_suffix("").exists():
            _unlink(path)
    writes = re.compile(rf"\.{re.escape(target.name)}\.[^/]*\.json\.{_OWNER}\.tmp")
    for path, _ in _orphans(target.parent, writes):
        _unlink(path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _create(path: Path) -> Path:
    # 0o666 and no chmod: the umask decides, as for any other file the job writes (not 0600 like mkstemp).
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return path


def _adopt(candidate: Path, mine: Path, urls: Sequence[str], algorithms: set[str], label: str) -> _Partial | None:
    record = _read_json(_meta_path(candidate))
    if record is None or record.get("url") not in urls:
        return None
    validator = Validator(etag=record.get("etag"), last_modified=record.get("last_modified"))
    if validator.if_range is None:
        return None
    try:
        # The rename is the claim: it succeeds for one caller only, lock or no lock.
        os.rename(candidate, mine)
        os.utime(mine)  # fresh mtime: other hosts must not take it for an idle orphan
    except FileNotFoundError:
        return None
    partial = _Partial(mine, algorithms, label)
    if os.fstat(partial.fd).st_ino != record.get("inode"):
        # The record belongs to other bytes (a concurrent park replaced one of the two files): start over.
        partial.restart()
        return partial
    logger.info("resuming %s from byte %d", candidate.name, partial.size)
    partial.resumed = partial.size > 0
    partial.note_source(record["url"], validator)
    return partial


def _park(partial: _Partial, target: Path, first_url: str) -> None:
    """Leave resumable bytes under the target's parked name; drop bytes that could not be resumed."""
    if partial.size > 0 and partial.url is not None and partial.validator and partial.validator.if_range:
        parked = _parked_path(target, first_url)
        with contextlib.suppress(OSError):
            os.replace(partial.path, parked)
            os.replace(partial.meta, _meta_path(parked))
            return
    _unlink(partial.path, partial.meta)


# --- fetching -------------------------------------------------------------------------------------------------


def _fetch(
    target: Path, urls: Sequence[str], expected: Mapping[str, str], *, timeout: float, retries: int, progress: bool
) -> None:
    partial = _claim(target, urls, set(expected))
    published = False
    try:
        failures: list[DownloadError] = []
        for url in urls:
            if failures:
                logger.warning("%s; trying %s", failures[-1], url)
            failure = _fetch_from(url, partial, expected, timeout=timeout, retries=retries, progress=progress)
            if failure is None:
                _publish(partial, target)
                published = True
                return
            failures.append(failure)
        raise _combined(failures)
    finally:
        if not published:
            partial.close()
            _park(partial, target, urls[0])


def _fetch_from(
    url: str, partial: _Partial, expected: Mapping[str, str], *, timeout: float, retries: int, progress: bool
) -> DownloadError | None:
    """Try ``url`` until ``partial`` holds the verified file (None) or the URL is given up (the error)."""
    failures = 0
    last: RetryableError | None = None
    refetched = False
    while failures <= retries:
        if last is not None:
            time.sleep(backoff_delay(failures - 1, last.retry_after))
        try:
            _transfer(url, partial, timeout=timeout, progress=progress)
        except RetryableError as exc:
            failures, last = failures + 1, exc
            logger.info("attempt %d of %d failed: %s", failures, retries + 1, exc)
            continue
        except FatalHTTPError as exc:
            return DownloadError(str(exc), url=url, status=exc.status)
        wrong = _mismatch(expected, partial.digests())
        if wrong is None:
            return None
        spliced = partial.resumed
        partial.restart()
        if not spliced or refetched:
            return _checksum_error(url, *wrong)  # the server sent these very bytes: asking again would not help
        # Bytes from several responses (or a crash) may be the culprit: one more try in one piece, free of charge.
        refetched, last = True, None
    attempts = f"{retries + 1} attempt{'s' if retries else ''}"
    return DownloadError(f"{url}: gave up after {attempts}: {str(last).removeprefix(url + ': ')}", url=url)


def _checksum_error(url: str, algorithm: str, expected: str, actual: str) -> ChecksumError:
    message = f"{url}: {algorithm} mismatch: expected {expected}, got {actual}"
    return ChecksumError(message, algorithm=algorithm, expected=expected, actual=actual, url=url)


def _transfer(url: str, partial: _Partial, *, timeout: float, progress: bool) -> None:
    """Make ``partial`` hold the whole body of ``url``, resuming from its bytes when they are from ``url``."""
    same_source = partial.url == url
    offset = partial.size if same_source else 0
    response = open_range(url, offset, partial.validator if same_source else None, timeout)
    with contextlib.closing(response.body):
        if response.offset != partial.size:
            partial.restart()  # a full body: whatever was on disk is of no use
        partial.resumed = partial.resumed or response.offset > 0
        partial.note_source(url, response.validator)
        if response.complete:
            return
        with _progress_bar(progress, response.total, partial.size, partial.label) as bar:
            while chunk := _read(response.body, url):
                partial.append(chunk)
                bar.update(len(chunk))
    if response.total is not None and partial.size != response.total:
        raise RetryableError(f"{url}: connection closed after {partial.size} of {response.total} bytes")


def _read(body: IO[bytes], url: str) -> bytes:
    try:
        return body.read1(_CHUNK)  # type: ignore[attr-defined,no-any-return]  # what has arrived, not _CHUNK bytes
    except Exception as exc:  # socket errors, timeouts, IncompleteRead: all mean "try again"
        raise RetryableError(f"{url}: {type(exc).__name__}: {exc}") from exc


def _progress_bar(enabled: bool, total: int | None, initial: int, label: str) -> Any:
    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=label,
        disable=not enabled,
        leave=False,
    )


def _publish(partial: _Partial, target: Path) -> None:
    st = partial.sync_and_close()
    digests = partial.digests()
    os.replace(partial.path, target)
    _fsync_dir(target.parent)
    _unlink(partial.meta)
    _remember_digests(target, st, digests)


def _combined(failures: Sequence[DownloadError]) -> DownloadError:
    if len(failures) == 1:
        return failures[0]
    message = f"all {len(failures)} URLs failed: " + "; ".join(str(f) for f in failures)
    last = failures[-1]
    if all(isinstance(f, ChecksumError) for f in failures):
        assert isinstance(last, ChecksumError)
        return ChecksumError(
            message, algorithm=last.algorithm, expected=last.expected, actual=last.actual, url=last.url
        )
    return DownloadError(message, url=last.url, status=last.status)
