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

import contextlib
import logging
import os
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ignite_ext._fs import exclusive, fsync_dir, unlink
from ignite_ext.data.download._http import FatalHTTPError, RetryableError, backoff_delay, check_scheme, open_range
from ignite_ext.data.download._partial import ORPHAN_MAX_AGE_S, Partial, claim, park
from ignite_ext.data.download._verify import CHUNK, expected_digests, is_valid, mismatch, remember_digests
from ignite_ext.data.download.extract import archive_stem, extract_archive
from ignite_ext.errors import ChecksumError, DownloadError

__all__ = ["ORPHAN_MAX_AGE_S", "ChecksumError", "DownloadError", "download_url"]

logger = logging.getLogger("ignite_ext.data.download")


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
    expected = expected_digests(sha256=sha256, md5=md5)
    root_dir = Path(root).expanduser()
    root_dir.mkdir(parents=True, exist_ok=True)
    target = root_dir / _target_name(url, filename)
    if not is_valid(target, expected):
        with exclusive(_lock_path(target), f"another process's download of {target}", logger):
            # Whoever held the lock before us may have just published it.
            if not is_valid(target, expected):
                _fetch(target, urls, expected, timeout=timeout, retries=retries, progress=progress)
    if not extract:
        return target
    return extract_archive(target, root_dir / archive_stem(target.name))


def _target_name(url: str, filename: str | None) -> str:
    name = filename if filename is not None else Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ValueError(f"cannot use {name!r} as a file name for {url!r}; pass a plain filename=")
    return name


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _fetch(
    target: Path, urls: Sequence[str], expected: Mapping[str, str], *, timeout: float, retries: int, progress: bool
) -> None:
    partial = claim(target, urls, set(expected))
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
            park(partial, target, urls[0])


def _fetch_from(
    url: str, partial: Partial, expected: Mapping[str, str], *, timeout: float, retries: int, progress: bool
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
        wrong = mismatch(expected, partial.digests())
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


def _transfer(url: str, partial: Partial, *, timeout: float, progress: bool) -> None:
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
        return body.read1(CHUNK)  # type: ignore[attr-defined,no-any-return]  # what has arrived, not CHUNK bytes
    except Exception as exc:  # socket errors, timeouts, IncompleteRead: all mean "try again"
        raise RetryableError(f"{url}: {type(exc).__name__}: {exc}") from exc


def _progress_bar(enabled: bool, total: int | None, initial: int, label: str) -> Any:
    from tqdm.auto import tqdm  # only the fetching process shows a bar: the others need not import it

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


def _publish(partial: Partial, target: Path) -> None:
    st = partial.sync_and_close()
    digests = partial.digests()
    os.replace(partial.path, target)
    fsync_dir(target.parent)
    unlink(partial.meta)
    remember_digests(target, st, digests)


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
