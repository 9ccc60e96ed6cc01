"""The holders of one file in one job, in the order they came: who fetches from the origin, who from whom.

Through the store every rank of the job shares (:func:`ignite_ext.distributed.job_store`), under
``ignite_ext/relay/<block>/<file>/``, where ``<block>`` is the scheduled block's number
(:func:`ignite_ext.distributed.current_block`: a retry in a later block starts a chain of its own) and ``<file>``
hashes the file's first URL, name and expected digests:

.. code-block:: text

    key                 written by                            what
    holders             each holder as it joins (add)         its place: 1 fetches from the origin, p from p - 1
    secret              the first holder to ask (compare_set) 32 random bytes, hex: the relays' shared secret
    at/<p>              holder p, before it fetches           its rank and its relay's address (JSON)
    failed              a holder the origin failed (once)     the error (JSON): every holder raises it
    outcome             the first holder fetching from the    the file's SHA-256 and size, checked by every
                        origin to publish or stop             relayed copy; or "failed" (the origin failed it), or
                        (compare_set)                         "abandoned" (it stopped for a reason of its own: its
                                                              disk, its deadline): no digest is coming. One key,
                                                              so that a holder waits on it alone, polling nothing

The store is the trust boundary: whoever can reach it can read the secret and post a digest, as they can already
take part in the process group's rendezvous.

Per holder: one ``add``, two requests for the secret, one ``set``, one ``wait`` and ``get`` per holder it turns
to (its predecessor, unless that one is lost), one ``check`` per relay lost; one ``wait`` and ``get`` of the
digest when no digest was given. O(1) per holder and per rank that holds nothing; the keys (O(holders), a few
hundred bytes each) live as long as the store, which ends with the job.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ignite_ext.errors import ChecksumError, DownloadError

# compare_set on a missing key with this expected value reads without writing (torch's stores before 2.2 have no
# check): one request that never blocks.
_ABSENT = "\x00"

__all__ = ["Chain", "Holder", "file_id"]


def file_id(first_url: str, name: str, expected: Mapping[str, str]) -> str:
    """What names one file across the job's hosts (whatever directory each keeps it in).

    Examples:
        >>> from ignite_ext.data.download._chain import file_id
        >>> file_id("https://example.com/a.tar", "a.tar", {}) == file_id("https://example.com/a.tar", "a.tar", {})
        True
    """
    key = json.dumps([first_url, name, sorted(expected.items())])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Holder:
    """Holder ``place`` of the chain: its rank, and where its relay listens."""

    place: int
    rank: int
    host: str
    port: int


class Chain:
    """The chain of one file through the job's store (see the module docstring)."""

    def __init__(self, store: Any, file: str, block: int = 0) -> None:
        self.store = store
        self.file = file
        # Here, not at import: the download path imports without torch and ignite (ignite_ext.distributed's).
        from ignite_ext.distributed.store.keys import relay_key

        self.prefix = relay_key(block, file)

    def join(self) -> int:
        """This holder's place: 1 for the first to come."""
        return int(self.store.add(f"{self.prefix}/holders", 1))

    def secret(self) -> bytes:
        key = f"{self.prefix}/secret"
        self.store.compare_set(key, "", secrets.token_hex(32))
        return bytes.fromhex(bytes(self.store.get(key)).decode())

    def post(self, holder: Holder) -> None:
        self.store.set(f"{self.prefix}/at/{holder.place}", json.dumps([holder.rank, holder.host, holder.port]))

    def holder(self, place: int, timeout: float) -> Holder | None:
        """Holder ``place``, once it has said where it listens (None if it has not within ``timeout``)."""
        key = f"{self.prefix}/at/{place}"
        if not self._wait(key, timeout):
            return None
        rank, host, port = json.loads(bytes(self.store.get(key)))
        return Holder(place, int(rank), str(host), int(port))

    def post_failure(self, exc: DownloadError) -> None:
        """The origin failed the holder fetching from it: every holder raises this error."""
        record: dict[str, Any] = {"message": str(exc), "url": exc.url, "status": exc.status}
        if isinstance(exc, ChecksumError):
            record["checksum"] = [exc.algorithm, exc.expected, exc.actual]
        self.store.compare_set(f"{self.prefix}/failed", "", json.dumps(record))
        self.store.compare_set(f"{self.prefix}/outcome", "", json.dumps("failed"))

    def failure(self) -> DownloadError | None:
        """The error the origin's holder gave up with, if it did (one read), as a new error of its type."""
        posted = bytes(self.store.compare_set(f"{self.prefix}/failed", _ABSENT, ""))
        if posted == _ABSENT.encode():
            return None
        record = json.loads(posted)
        message, url, status = record["message"], record["url"], record["status"]
        if "checksum" in record:
            algorithm, expected, actual = record["checksum"]
            return ChecksumError(message, algorithm=algorithm, expected=expected, actual=actual, url=url)
        return DownloadError(message, url=url, status=status)

    def abandon(self) -> None:
        """A holder fetching from the origin stopped without a copy, for a reason of its own."""
        self.store.compare_set(f"{self.prefix}/outcome", "", json.dumps("abandoned"))

    def post_digest(self, sha256: str, size: int) -> None:
        """The digest of a copy that came from the origin (the first outcome posted stands)."""
        self.store.compare_set(f"{self.prefix}/outcome", "", json.dumps([sha256, size]))

    def outcome(self, timeout: float) -> tuple[str, int] | str | None:
        """What the holder fetching from the origin posted: its copy's digest, or why none is coming.

        ``(SHA-256, size)``, ``"failed"`` or ``"abandoned"``; None if nothing is posted within ``timeout`` (one
        server-side wait).
        """
        key = f"{self.prefix}/outcome"
        if not self._wait(key, timeout):
            return None
        posted = json.loads(bytes(self.store.get(key)))
        return posted if isinstance(posted, str) else (str(posted[0]), int(posted[1]))

    def _wait(self, key: str, timeout: float) -> bool:
        """Whether ``key`` is set within ``timeout`` (one server-side wait); a lost store still raises."""
        try:
            self.store.wait([key], timedelta(seconds=max(0.001, timeout)))
        except RuntimeError as exc:  # torch's DistStoreError from 2.2 on, a RuntimeError before
            if "timeout" not in str(exc).lower():
                raise
            return False
        return True
