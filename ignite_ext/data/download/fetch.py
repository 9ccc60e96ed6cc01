"""Race-free, resumable, verified downloads: :func:`download_url`.

How one file gets from a URL to ``root/filename``, whatever else runs at the same time:

* **Lock, only to save work.** Callers for the same target take an exclusive POSIX record lock on
  ``root/.<name>.lock`` (:mod:`ignite_ext._locks`); one fetches, the others wait and then find the verified file.
  The kernel drops the lock when its holder dies, so a killed process never leaves a lock that blocks the next
  call; a lock another user's process holds is waited for at most ``2 * (timeout + low_speed_time)`` seconds
  (``deadline`` when shorter). Nothing below depends on the lock: where locking silently succeeds for everyone
  (some NFS, Lustre and GPFS mounts) several callers fetch, and every one of them still publishes a complete,
  verified file.
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

import contextlib
import errno
import logging
import math
import os
import re
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from ignite_ext._fs import fsync_dir, sidecar_stem, unlink
from ignite_ext._locks import LockWaitExpired, exclusive
from ignite_ext.data.download._failures import forget_failure, raise_shared_failure, share_failure
from ignite_ext.data.download._http import (
    FatalHTTPError,
    LengthConflict,
    RangeMismatch,
    Response,
    RetryableError,
    SpeedFloor,
    backoff_delay,
    check_scheme,
    open_range,
)
from ignite_ext.data.download._job import (
    LOW_SPEED_LIMIT,
    LOW_SPEED_TIME_S,
    DeadlinePassed,
    Job,
    NoSpace,
    check_space,
    progress_bar,
)
from ignite_ext.data.download._parallel import fetch_segments, plan_segments
from ignite_ext.data.download._partial import ORPHAN_MAX_AGE_S, Partial, Segment, claim, park
from ignite_ext.data.download._relaying import from_relays, gave_up, hand_over, in_this_block
from ignite_ext.data.download._verify import CHUNK, expected_digests, is_valid, mismatch, remember_digests
from ignite_ext.data.download.extract import DEFAULT_MAX_TOTAL_BYTES, archive_stem, extract_archive
from ignite_ext.errors import ChecksumError, DownloadError

__all__ = ["ORPHAN_MAX_AGE_S", "ChecksumError", "DownloadError", "check_arguments", "download_url", "writable_root"]

logger = logging.getLogger("ignite_ext.data.download")

# The names of the files kept beside a target: a target named like one would be overwritten by another's.
_BOOKKEEPING = re.compile(
    r"\..+\.(?:lock|verified\.json|failed\.json|part|part\.json|tmp|tmp\.json|extract\.lock|extracting|old)"
)


def download_url(
    url: str,
    root: str | os.PathLike[str],
    filename: str | None = None,
    md5: str | None = None,
    *,
    sha256: str | None = None,
    mirrors: Sequence[str] = (),
    extract: bool = False,
    timeout: float = 30.0,
    retries: int = 3,
    deadline: float | None = None,
    connections: int = 1,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    progress: bool = True,
    low_speed_limit: float = LOW_SPEED_LIMIT,
    low_speed_time: float = LOW_SPEED_TIME_S,
    relay: bool = False,
) -> Path:
    """Download ``url`` to ``root/filename`` once per filesystem, verified, atomically and resumably.

    Safe to call from every rank of a job, from several jobs, or from plain processes at once: one caller
    fetches while the others wait on a file lock, and all of them return the same verified file. An existing
    file is returned as is when no checksum is given, and fetched again when it does not match the one given;
    digests are remembered, so a verified file is not hashed again on every call. See the module docstring for
    the files involved, and the downloads guide for the guarantees.

    The first four arguments are those of ``torchvision.datasets.utils.download_url``, in its order, and its errors
    are of the kinds torchvision's callers catch (:class:`DownloadError` is a :class:`urllib.error.URLError`,
    :class:`ChecksumError` also a :class:`RuntimeError`), so this function can stand in for it: a dataset's loop
    over its mirrors goes on to the next one. Each failing mirror costs its ``retries`` first (see the downloads
    guide).

    With ``relay=True``, inside a scheduled block of a multi-rank job (``one_rank_first(local=True)``,
    ``SharedPath``, any block), the processes that fetch the same file into different directories fetch it from
    the origin once for the job: the first to come fetches, the others receive it from one another while it
    downloads, through a port each of them opens (see :mod:`ignite_ext.data.download.jobwide`;
    :func:`~ignite_ext.data.download_for_job` asks for it). By default nothing is relayed and no port is opened.

    Args:
        url: ``http``, ``https`` or ``file`` URL (non-ASCII characters are encoded as UTF-8, hosts as IDNA).
        root: directory to download into; created if missing.
        filename: name of the file in ``root``; by default the last segment of the URL's path.
        md5: expected MD5 of the file, in hex (fourth, as torchvision's ``download_url`` takes it).
        sha256: expected SHA-256 of the file, in hex.
        mirrors: further URLs of the same file, tried in order when ``url`` fails.
        extract: extract the archive with :func:`~ignite_ext.data.extract_archive` into ``root/<stem>``, where
            ``<stem>`` is the file name without its archive suffix (``data.tar.gz`` → ``root/data``), and
            return that directory.
        timeout: seconds to wait for a connection or for the next bytes of the body.
        retries: further attempts per URL after connection errors, timeouts, short bodies, bodies below the
            low-speed floor, 5xx and 429, with exponential backoff (a short ``Retry-After`` is honoured); each
            attempt resumes where the last stopped when the server allows it.
        deadline: seconds this process may spend fetching (all attempts and mirrors together, not counting the
            wait for another process's fetch); None: no bound beyond ``timeout`` per read, the low-speed floor
            per attempt and ``retries``. Also bounds the wait for a lock that another user's process holds.
        connections: fetch a large file over this many concurrent range requests (each at least 4 MiB), when
            the server serves ranges of it and names its version with a strong validator; one stream otherwise.
            Resume, verification and the atomic publish are the same either way.
        max_total_bytes: with ``extract=True``, the bound on the archive's total uncompressed size.
        progress: show a progress bar (only the process that fetches shows one, and only on a terminal).
        low_speed_limit: the low-speed floor, in bytes per second (curl's ``--speed-limit``): an attempt whose
            body stays below it for ``low_speed_time`` seconds is given up and counts as a failed attempt (the
            next one resumes from the bytes held). The default, 1 KiB/s, is far below any link a dataset comes
            over, yet catches a server that keeps the connection alive with a byte now and then, which ``timeout``
            cannot see; 0 turns the floor off.
        low_speed_time: seconds a body may stay below ``low_speed_limit`` (curl's ``--speed-time``); the default,
            30 s, rides out a stall of TCP retransmissions or a proxy that buffers before the bytes flow again.
        relay: inside a scheduled block of a multi-rank job, take the bytes from the processes that fetched them
            before this one and serve them to those after it (a listening port on the interface that routes to
            ``MASTER_ADDR``, while the block runs); ``IGNITE_EXT_RELAY=0`` turns it off whatever this says (the
            relay's address and ports are settings too: :doc:`/settings`).

    Returns:
        The path of the file, or with ``extract=True`` of the directory it was extracted into.

    Raises:
        ValueError: a URL scheme other than ``http``, ``https`` and ``file``, a malformed digest or filename.
        ChecksumError: every source served bytes with another digest than expected.
        DownloadError: a 404 or other 4xx (no retry), all attempts on all URLs failed, the deadline passed, or
            the disk cannot hold the file or, with ``extract=True``, its extraction (its message names the URL or
            the archive, and the path). Or another user's process on this host held the file's lock for
            ``2 * (timeout + low_speed_time)`` seconds (``deadline`` when shorter): the message names the lock file
            and that process (pid, user, command); a lock of this user's processes is waited for as before. Or
            ``root`` cannot be made or written (a read-only mount, another user's directory): the message names it.
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
    .. versionchanged:: 0.3.0
       ``low_speed_limit`` and ``low_speed_time``: a low-speed floor by default. The wait for a lock that another
       user's process holds is bounded. Inside a scheduled block of a job, one fetch from the origin per job.
    .. versionchanged:: 0.4.0
       Raises what torchvision's callers catch: ``DownloadError`` is a ``URLError``, ``ChecksumError`` also a
       ``RuntimeError`` (a torchvision dataset stopped at its first failing mirror).
       A ``root`` that cannot be written is a :class:`DownloadError` naming it, before any lock or temp file (when
       the file is to be fetched: a verified one is returned from a read-only ``root`` as before).
       ``relay``: relaying inside a scheduled block only when asked (it was ``download_url``'s doing in any block,
       opening a port unasked); :func:`~ignite_ext.data.download_for_job` asks for it.
    """
    urls = [url, *mirrors]
    check_arguments(urls, timeout, retries, deadline, connections, low_speed_limit, low_speed_time)
    expected = expected_digests(sha256=sha256, md5=md5)
    root_dir = Path(root).expanduser()
    target = root_dir / _target_name(url, filename)
    # Twice the longest one attempt of this call may go without progress: a stranger's lock is given up after it.
    patience_s = min(2.0 * (timeout + low_speed_time), deadline or math.inf)
    if not is_valid(target, expected, urls):  # a verified file is returned from a read-only root too
        writable_root(root_dir, url)
        try:
            with exclusive(_lock_path(target), f"another process's download of {target}", logger, patience_s) as waited:
                # Whoever held the lock before us may have just published it, or just failed.
                valid = is_valid(target, expected, urls)
                if waited and valid:
                    logger.info("fetched by another process: %s", target)
                elif not valid:
                    if waited:
                        raise_shared_failure(target, urls)
                        logger.info("the process before this one left no %s; fetching it", target.name)
                    ends_at = None if deadline is None else time.monotonic() + deadline
                    try:
                        job = Job(
                            expected,
                            timeout,
                            retries,
                            progress,
                            ends_at,
                            connections,
                            low_speed_limit,
                            low_speed_time,
                            relay,
                        )
                        _fetch(target, urls, job)
                    except DownloadError as exc:
                        share_failure(target, urls, exc)
                        raise
                    forget_failure(target)
        except LockWaitExpired as exc:  # only the wait for the lock raises it
            if not is_valid(target, expected, urls):  # the file may have come meanwhile (from a writer without it)
                raise DownloadError(f"{url}: {exc}", url=url) from exc
    if not extract:
        return target
    return extract_archive(target, root_dir / archive_stem(target.name), max_total_bytes=max_total_bytes)


def writable_root(root: str | os.PathLike[str], url: str) -> Path:
    """Make ``root`` (and its parents) if missing and check that this process may write into it.

    A download writes its temp file, lock and records into ``root``: where it cannot (a read-only mount, a directory
    of another user's), this says so at once, naming ``root``, rather than failing later on a hidden file in it.

    Args:
        root: the directory to download into.
        url: the URL to name in the error.

    Returns:
        ``root``, with ``~`` expanded.

    Raises:
        DownloadError: ``root`` cannot be made or written; its ``errno`` and ``__cause__`` say why.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data.download.fetch import writable_root
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     writable_root(Path(tmp, "data"), "https://example.org/a.bin").is_dir()
        True

    .. versionadded:: 0.4.0
    """
    root_dir = Path(root).expanduser()
    try:
        root_dir.mkdir(parents=True, exist_ok=True)
        # access(2) answers for this process's ids, ACLs and read-only mounts without writing anything.
        if not os.access(root_dir, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            readonly = os.statvfs(root_dir).f_flag & os.ST_RDONLY
            code = errno.EROFS if readonly else errno.EACCES
            raise OSError(code, os.strerror(code), str(root_dir))
    except OSError as exc:
        error = DownloadError(f"{url}: cannot write into {root_dir}: {exc.strerror or exc}", url=url)
        error.errno = exc.errno
        raise error from exc
    return root_dir


def check_arguments(
    urls: Sequence[str],
    timeout: float,
    retries: int,
    deadline: float | None,
    connections: int,
    low_speed_limit: float,
    low_speed_time: float,
) -> None:
    """Raise ``ValueError`` for an argument :func:`download_url` cannot take (the digests aside).

    .. versionadded:: 0.3.0
    """
    for each in urls:
        check_scheme(each)
    if retries < 0 or not timeout > 0 or (deadline is not None and not deadline > 0):
        raise ValueError(
            f"need retries >= 0, timeout > 0 and deadline > 0 or None, got {retries=}, {timeout=}, {deadline=}"
        )
    if not low_speed_limit >= 0 or not low_speed_time > 0:
        raise ValueError(f"need low_speed_limit >= 0 and low_speed_time > 0, got {low_speed_limit=}, {low_speed_time=}")
    if isinstance(connections, bool) or not isinstance(connections, int) or not 1 <= connections <= 64:
        raise ValueError(f"connections must be an int from 1 to 64, got {connections!r}")


def _target_name(url: str, filename: str | None) -> str:
    name = filename if filename is not None else Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ValueError(f"cannot use {name!r} as a file name for {url!r}; pass a plain filename=")
    if len(name.encode("utf-8", "surrogateescape")) > 255:
        raise ValueError(f"{name[:60]!r}... is longer than the 255 bytes a file name may have; pass filename=")
    if _BOOKKEEPING.fullmatch(name):
        raise ValueError(
            f"{name!r} is named like a download's own bookkeeping file (lock, record, partial); pass filename="
        )
    return name


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{sidecar_stem(target.name)}.lock")


def _fetch(target: Path, urls: Sequence[str], job: Job) -> None:
    partial = claim(target, urls, set(job.expected))
    member = None
    published = False
    try:
        relays = in_this_block() if job.relay else None
        # Asked, in a scheduled block of a job: serve these bytes to the holders after this one, take them from those
        # before.
        member = relays.join(target, urls, job, partial) if relays is not None else None
        with _no_space_is_a_download_error(urls[0], partial, target):
            if member is not None and not member.from_origin and from_relays(member, partial, job):
                _publish(partial, target)
                published = True
                hand_over(member, partial, target)
                return
        if member is not None:
            member.from_origin = True  # every holder before this one was lost: the origin it is
        failures: list[DownloadError] = []
        for url in urls:
            if failures:
                logger.warning("%s; trying %s", failures[-1], url)
            with _no_space_is_a_download_error(url, partial, target):
                failure = _fetch_from(url, partial, target, job)
            if failure is None:
                _publish(partial, target)
                published = True
                if member is not None:
                    hand_over(member, partial, target)
                return
            failures.append(failure)
            if isinstance(failure, DeadlinePassed):
                break
        error = _combined(failures)
        if member is not None and not any(isinstance(f, DeadlinePassed | NoSpace) for f in failures):
            gave_up(member, error)  # the origin's doing: every holder raises it, none asks the origin again
        raise error
    finally:
        if not published:
            if member is not None:
                gave_up(member, None)  # for a reason of its own, if not the origin's (posted above)
            partial.close()
            park(partial, target, urls[0])


def _say_retry(failures: int, retries: int, exc: RetryableError) -> None:
    """Say a failed attempt: the first of a URL at WARNING, the next ones at DEBUG.

    WARNING is the level a user sees by default (as torchvision prints each mirror that fails), so a file that
    takes long says why, in one line per URL and call. With no retry left the URL's error says it all.
    """
    if failures == 1 and retries > 0:
        logger.warning("%s; retrying it %d more time(s), with backoff", exc, retries)
    else:
        logger.debug("attempt %d of %d failed: %s", failures, retries + 1, exc)


@contextlib.contextmanager
def _no_space_is_a_download_error(url: str, partial: Partial, target: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or isinstance(exc, DownloadError):
            raise
        partial.discard = True  # resuming into a full disk would fail again at once
        raise DownloadError(
            f"{url}: no space left on the device of {target.parent} after {partial.size} bytes "
            f"({os.strerror(exc.errno)}); nothing was kept",
            url=url,
        ) from exc


def _fetch_from(url: str, partial: Partial, target: Path, job: Job) -> DownloadError | None:
    """Try ``url`` until ``partial`` holds the verified file (None) or the URL is given up (the error)."""
    failures = 0
    last: RetryableError | None = None
    refetched = False
    while failures <= job.retries:
        try:
            job.check_deadline(url)
            if last is not None:
                _sleep(backoff_delay(failures - 1, last.retry_after), job, url)
            _transfer(url, partial, target, job)
        except (DeadlinePassed, NoSpace) as exc:
            partial.discard = partial.discard or isinstance(exc, NoSpace)
            return exc
        except RetryableError as exc:
            if isinstance(exc, RangeMismatch):
                # The server's range replies cannot continue these bytes: whole bodies only, for the rest of the call.
                partial.restart()
                partial.no_resume = True
            failures, last = failures + 1, exc
            _say_retry(failures, job.retries, exc)
            continue
        except FatalHTTPError as exc:
            if isinstance(exc, LengthConflict):
                partial.discard = True  # bytes of a version the server lies about: nothing to resume from
            return DownloadError(str(exc), url=url, status=exc.status or None)
        wrong = mismatch(job.expected, partial.digests())
        if wrong is None:
            return None
        spliced = partial.resumed
        partial.restart()
        if not spliced or refetched:
            return _checksum_error(url, *wrong)  # the server sent these very bytes: asking again would not help
        # Bytes from several responses (or a crash) may be the culprit: one more try in one piece, free of charge.
        partial.no_resume = True
        refetched, last = True, None
    attempts = f"{job.retries + 1} attempt{'s' if job.retries else ''}"
    return DownloadError(f"{url}: gave up after {attempts}: {str(last).removeprefix(url + ': ')}", url=url)


def _sleep(seconds: float, job: Job, url: str) -> None:
    if job.ends_at is not None and time.monotonic() + seconds > job.ends_at:
        time.sleep(max(0.0, job.ends_at - time.monotonic()))
        job.check_deadline(url)
    time.sleep(seconds)


def _checksum_error(url: str, algorithm: str, expected: str, actual: str) -> ChecksumError:
    message = (
        f"{url}: {algorithm} mismatch: expected {expected}, got {actual}: the {algorithm} passed is wrong, or the "
        "file changed on the server; check the digest, and pass the new one if the change is expected"
    )
    return ChecksumError(message, algorithm=algorithm, expected=expected, actual=actual, url=url)


def _transfer(url: str, partial: Partial, target: Path, job: Job) -> None:
    """Make ``partial`` hold the whole body of ``url``, resuming from its bytes when they are from ``url``."""
    same_source = partial.url == url and not partial.no_resume
    offset = partial.size if same_source else 0
    validator = partial.validator if same_source else None
    # With a checksum the bytes are judged by it; without one, a strong ETag given two lengths publishes nothing.
    lengths = None if job.expected else partial.lengths_of(url)
    response = open_range(url, offset, validator, job.timeout, partial.total if same_source else None, lengths=lengths)
    partial.note_length(url, response.validator, response.total)
    with contextlib.closing(response.body):
        if response.offset != partial.size:
            partial.restart()  # a full body: whatever was on disk is of no use
        if response.complete and not job.expected:
            # A 416 says the bytes held are the whole file; with no checksum to confirm it, fetch it whole instead.
            raise RangeMismatch(f"{url}: HTTP 416 for bytes={offset}- and no checksum to confirm the bytes held")
        partial.resumed = partial.resumed or response.offset > 0
        partial.note_source(url, response.validator, response.total if response.total is not None else partial.total)
        if response.complete:
            return
        check_space(url, target, (response.end or 0) - partial.size)
        with progress_bar(job.progress, response.total, partial.size, partial.label) as bar:
            segments = _segments(response, partial, job)
            if segments is not None:
                logger.info("fetching %s over %d connections", url, len(segments))
                fetch_segments(
                    url,
                    partial,
                    response.body,
                    segments,
                    response.validator,
                    timeout=job.timeout,
                    retries=job.retries,
                    low_speed=(job.low_speed_limit, job.low_speed_time),
                    on_bytes=bar.update,
                    check_deadline=lambda: job.check_deadline(url),
                )
                return
            floor = SpeedFloor(url, job.low_speed_limit, job.low_speed_time)
            while chunk := _read(response.body, url):
                partial.append(chunk)  # kept before the floor may give up: the next attempt resumes from it
                bar.update(len(chunk))
                floor.count(len(chunk))
                job.check_deadline(url)
    expected_end = response.end if response.end is not None else response.total
    if expected_end is not None and partial.size != expected_end:
        raise RetryableError(f"{url}: connection closed after {partial.size} of {expected_end} bytes")


def _segments(response: Response, partial: Partial, job: Job) -> list[Segment] | None:
    """The segments of a parallel fetch of the rest of ``response``, or None to stream it."""
    if job.connections < 2 or partial.no_resume or not response.ranges or response.total is None:
        return None
    if response.validator.if_range is None or response.end != response.total:
        return None  # no strong validator: segments could come from several versions of the file
    segments = plan_segments(partial.size, response.total, job.connections)
    return segments if len(segments) > 1 else None


def _read(body: IO[bytes], url: str) -> bytes:
    try:
        return body.read1(CHUNK)  # type: ignore[attr-defined,no-any-return]  # what has arrived, not CHUNK bytes
    except Exception as exc:  # socket errors, timeouts, IncompleteRead: all mean "try again"
        raise RetryableError(f"{url}: {type(exc).__name__}: {exc}") from exc


def _publish(partial: Partial, target: Path) -> None:
    st = partial.sync_and_close()
    digests = partial.digests()
    os.replace(partial.path, target)
    fsync_dir(target.parent)
    unlink(partial.meta)
    remember_digests(target, st, digests, partial.url)


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
