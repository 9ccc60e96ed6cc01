"""A failed fetch, shared with the processes that waited for it: they raise the same error at once.

Without this, every process waiting on the lock re-runs the whole retry schedule after the previous one gave up:
eight job prologues against a failing server sent 32 requests, and the last one exited after 93 s. A fetcher that
fails writes ``root/.<name>.failed.json`` (which URLs, the error, who, when); a process that *waited* for the lock
and finds a record of the same URLs younger than :data:`FAILURE_SHARE_S` raises that error instead of fetching. A
process that did not wait (it came later) tries again; a successful fetch deletes the record.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from ignite_ext._fs import read_json, sidecar_stem, unlink, write_json
from ignite_ext.errors import ChecksumError, DownloadError

__all__ = ["FAILURE_SHARE_S", "failure_path", "forget_failure", "raise_shared_failure", "share_failure"]

#: Seconds during which the processes that waited for a failed fetch raise its error instead of fetching again.
FAILURE_SHARE_S = 30.0


def failure_path(target: Path) -> Path:
    """Where the failure of the last fetch of ``target`` is recorded."""
    return target.with_name(f".{sidecar_stem(target.name)}.failed.json")


def _key(urls: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]


def share_failure(target: Path, urls: Sequence[str], exc: DownloadError) -> None:
    """Record ``exc`` for the processes waiting on the lock (best effort: a read-only folder shares nothing)."""
    record = {
        "urls": _key(urls),
        "type": "ChecksumError" if isinstance(exc, ChecksumError) else "DownloadError",
        "message": str(exc),
        "status": exc.status,
        "url": exc.url,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
    }
    with contextlib.suppress(OSError):
        write_json(failure_path(target), record)


def forget_failure(target: Path) -> None:
    """Delete the record of an earlier failure (the file is now published)."""
    unlink(failure_path(target))


def raise_shared_failure(target: Path, urls: Sequence[str]) -> None:
    """Raise the error of the fetch this process waited for, if it failed on the same URLs moments ago."""
    record = read_json(failure_path(target))
    if record is None or record.get("urls") != _key(urls):
        return
    age = time.time() - float(record.get("time", 0.0))
    if not 0 <= age <= FAILURE_SHARE_S:
        return
    message = (
        f"{record.get('message')} (the fetch this process waited for, by pid {record.get('pid')} on "
        f"{record.get('host')}, failed {age:.0f} s ago; not retried within {FAILURE_SHARE_S:.0f} s)"
    )
    url = record.get("url") if isinstance(record.get("url"), str) else None
    if record.get("type") == "ChecksumError":
        raise ChecksumError(message, url=url)
    status = record.get("status")
    raise DownloadError(message, url=url, status=status if isinstance(status, int) else None)
