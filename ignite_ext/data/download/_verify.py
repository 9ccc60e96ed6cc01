"""Checksums of downloaded files: expected digests, hashing, and the record that spares hashing a file again.

The digests of a published file are kept in ``root/.<name>.verified.json`` with its size, ``mtime_ns`` and inode; a
later call with a checksum compares against that record and only hashes the file again when it changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ignite_ext._fs import read_json, sidecar_stem, write_json

__all__ = [
    "CHUNK",
    "digests_of",
    "expected_digests",
    "file_key",
    "hash_file",
    "hashers",
    "is_valid",
    "mismatch",
    "remember_digests",
    "verified_path",
]

logger = logging.getLogger("ignite_ext.data.download")
_WARNED: set[tuple[str, str]] = set()


def _first_warning(target: Path, url: str) -> bool:
    key = (str(target), url)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


#: Bytes read or written at a time.
CHUNK = 1 << 20
DIGEST_LENGTHS = {"sha256": 64, "md5": 32}


def expected_digests(**given: str | None) -> dict[str, str]:
    expected = {}
    for algorithm, value in given.items():
        if value is None:
            continue
        digest = value.strip().lower()
        if len(digest) != DIGEST_LENGTHS[algorithm] or not re.fullmatch(r"[0-9a-f]+", digest):
            raise ValueError(f"{algorithm} must be {DIGEST_LENGTHS[algorithm]} hex digits, got {value!r}")
        expected[algorithm] = digest
    return expected


def verified_path(target: Path) -> Path:
    return target.with_name(f".{sidecar_stem(target.name)}.verified.json")


def hashers(algorithms: Iterable[str]) -> dict[str, Any]:
    # Integrity checks, not security: MD5 must stay usable on FIPS-restricted builds too.
    return {name: hashlib.new(name, usedforsecurity=False) for name in algorithms}


def hash_file(path: Path, algorithms: Iterable[str]) -> dict[str, str]:
    running = hashers(algorithms)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            for hasher in running.values():
                hasher.update(chunk)
    return {name: hasher.hexdigest() for name, hasher in running.items()}


def file_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def remember_digests(target: Path, st: os.stat_result, digests: Mapping[str, str], url: str | None = None) -> None:
    """Record the digests of the published ``target`` (and, when it was just fetched, where from)."""
    if url is None:  # hashed again: keep what the record says of where the file came from
        old = read_json(verified_path(target))
        url = old.get("url") if old is not None and isinstance(old.get("url"), str) else None
    with contextlib.suppress(OSError):  # a read-only dataset directory just means hashing again next time
        write_json(verified_path(target), {**file_key(st), "digests": dict(digests), "url": url})


def digests_of(target: Path, st: os.stat_result, algorithms: set[str]) -> dict[str, str]:
    """The digests of ``target``, from the record if it still describes the file, else by hashing it."""
    record = read_json(verified_path(target))
    if record is not None and all(record.get(k) == v for k, v in file_key(st).items()):
        known = record.get("digests")
        if isinstance(known, dict) and algorithms <= known.keys():
            return known
    digests = hash_file(target, algorithms | {"sha256"})
    remember_digests(target, st, digests)
    return digests


def mismatch(expected: Mapping[str, str], actual: Mapping[str, str]) -> tuple[str, str, str] | None:
    for algorithm, digest in expected.items():
        if actual[algorithm] != digest:
            return algorithm, digest, actual[algorithm]
    return None


def is_valid(target: Path, expected: Mapping[str, str], urls: Sequence[str] = ()) -> bool:
    """Whether ``target`` exists and has the expected digests (any existing file when none are expected).

    Without a checksum, a file that the record says came from another URL than ``urls`` is still returned (two
    URLs with one basename share a target), with a warning naming both: ``filename=`` keeps them apart.
    """
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    if not expected:
        record = read_json(verified_path(target))
        source = record.get("url") if record is not None else None
        if urls and isinstance(source, str) and source not in urls and _first_warning(target, urls[0]):
            logger.warning(
                "%s was downloaded from %s, not from %s; returning it as is (no checksum to tell them apart): "
                "pass filename= to keep the two apart, or sha256= to verify",
                target,
                source,
                urls[0],
            )
        return True
    wrong = mismatch(expected, digests_of(target, st, set(expected)))
    if wrong is not None:
        logger.warning("%s has %s %s, expected %s; fetching it again", target, wrong[0], wrong[2], wrong[1])
    return wrong is None
