"""Caches that outlive their job (``persist=True``): the disk tier kept in ``disk_dir``, keyed by what it holds.

A persisted cache is a disk arena named ``ignite_ext_<uid>_persist_<key>.arena`` (and ``.lock``, mode 0600),
``<key>`` a digest of its identity (:func:`persist_key`); the next job of the same identity serves from it. Each
job that opens one checks a few samples drawn at random against the dataset (:func:`stale_sample`) and rebuilds it
on a difference (:class:`StaleCacheWarning`). The name carries no pid, so no sweep takes it; users hold a shared
``flock`` on it, the lock file's time records its last use, and each opening brings the user's persisted caches
under their cap (:func:`persist_cap`, :func:`evict`). The cache guide's *Across jobs* says what the identity sees.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Callable
from typing import Any

from ignite_ext.data.cache.identity import fingerprint_indices
from ignite_ext.data.cache.restart import cache_key
from ignite_ext.data.cache.shm import own_files, remove_files, unused
from ignite_ext.errors import IgniteExtError
from ignite_ext.settings import PERSIST_BYTES

# fmt: off
__all__ = [
    "PERSIST_RE", "StaleCacheWarning", "checked_indices", "evict", "persist_cap", "persist_key", "persisted_stem",
    "stale_sample",
]
# fmt: on

#: The names of persisted caches' files: the user's id, the identity's key, the kind of file.
PERSIST_RE = re.compile(r"^ignite_ext_(?P<uid>\d+)_persist_(?P<key>[0-9a-f]{16})\.(?P<kind>arena|lock)$")
#: Share of the directory's filesystem that the user's persisted caches there may take by default.
DEFAULT_CAP_FRACTION = 0.5
#: Published samples drawn at random and checked against the dataset (the first, middle and last are in the key).
CHECKED_AT_RANDOM = 3


class StaleCacheWarning(IgniteExtError, RuntimeWarning):
    """A persisted cache held samples that differ from its dataset's now (or could not be kept): it is rebuilt.

    Examples:
        >>> import warnings
        >>> from ignite_ext.data.cache import StaleCacheWarning
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("rebuilt", StaleCacheWarning)
        >>> issubclass(seen[0].category, RuntimeWarning)
        True

    .. versionadded:: 0.3.0
    """


def persist_key(*identity: object) -> int:
    """The key of a persisted cache of this identity (a non-zero 63-bit digest).

    Examples:
        >>> from ignite_ext.data.cache.persist import persist_key
        >>> persist_key("train", 100, "ab12", None) == persist_key("train", 100, "ab12", None)
        True
        >>> persist_key("train", 100, "ab12", None) == persist_key("train", 100, "ab12", "v2")
        False

    .. versionadded:: 0.3.0
    """
    return cache_key("persist", *identity)


def persisted_stem(directory: str, key: int) -> str:
    """The path, without suffix, of this user's persisted cache ``key`` in ``directory``.

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.persist import PERSIST_RE, persisted_stem
        >>> bool(PERSIST_RE.match(os.path.basename(persisted_stem("/tmp", 7)) + ".arena"))
        True

    .. versionadded:: 0.3.0
    """
    return os.path.join(directory, f"ignite_ext_{os.geteuid()}_persist_{key:016x}")


def persist_cap(directory: str) -> int:
    """Bytes this user's persisted caches in ``directory`` may take on disk, together.

    ``IGNITE_EXT_PERSIST_BYTES`` when set, else half of the filesystem's size (see :doc:`/settings`).

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.persist import persist_cap
        >>> os.environ["IGNITE_EXT_PERSIST_BYTES"] = "1000"
        >>> persist_cap("/tmp")
        1000
        >>> del os.environ["IGNITE_EXT_PERSIST_BYTES"]

    .. versionadded:: 0.3.0
    """
    given = PERSIST_BYTES.read()
    if given is not None:
        return given
    st = os.statvfs(directory)
    return int(st.f_blocks * st.f_frsize * DEFAULT_CAP_FRACTION)


def _own_persisted(directory: str) -> dict[str, tuple[int, float]]:
    """This user's persisted caches in ``directory``: arena path -> (bytes on disk, last use)."""
    found: dict[str, tuple[int, float]] = {}
    for name, match, st in own_files(directory, PERSIST_RE):
        path = os.path.join(directory, name)
        if match["kind"] == "arena":
            with contextlib.suppress(OSError):  # its lock file gone meanwhile: not a cache to count
                lock = os.stat(path[: -len(".arena")] + ".lock", follow_symlinks=False)
                found[path] = (st.st_blocks * 512, lock.st_mtime)
    return found


def evict(directory: str, keep: str, cap: int) -> list[str]:
    """Delete this user's least recently used persisted caches in ``directory`` until they fit ``cap`` bytes.

    Never ``keep`` (the arena being opened), never one a process holds. Returns the arenas deleted. Called under
    the user's creation lock of the directory.

    Examples:
        >>> import tempfile
        >>> from ignite_ext.data.cache.persist import evict
        >>> evict(tempfile.gettempdir(), keep="", cap=1 << 40)
        []

    .. versionadded:: 0.3.0
    """
    caches = _own_persisted(directory)
    total = sum(size for size, _ in caches.values())
    deleted = []
    for path, (size, _) in sorted(caches.items(), key=lambda item: item[1][1]):  # least recently used first
        if total <= cap:
            break
        if path == keep or not unused(path):
            continue
        if remove_files([path]):
            remove_files([path[: -len(".arena")] + ".lock"])
            deleted.append(path)
            total -= size
    return deleted


def checked_indices(n: int, published: Callable[[int], bool], seed: int) -> list[int]:
    """The indices a job checks on opening a persisted cache: a few published ones, drawn at random.

    Drawn among a few dozen indices (O(1)), in the order drawn, kept where ``published``; never the first, middle
    and last (:func:`~ignite_ext.data.cache.identity.fingerprint_indices`), whose content is in the cache's key.

    Examples:
        >>> from ignite_ext.data.cache.persist import checked_indices
        >>> checked = checked_indices(10, lambda i: i % 2 == 1, seed=1)
        >>> len(checked), all(i % 2 == 1 and i not in (0, 5, 9) for i in checked)
        (3, True)

    .. versionadded:: 0.3.0
    .. versionchanged:: 0.4.0
        The first indices drawn are checked, not the lowest of those drawn.
    """
    fixed = list(fingerprint_indices(n))
    rng = random.Random(seed)
    # A dict keeps the order drawn and drops repeats: every published index is as likely to be checked as any other.
    drawn = {i: None for i in (rng.randrange(n) for _ in range(48 if n else 0)) if i not in fixed and published(i)}
    return list(drawn)[:CHECKED_AT_RANDOM]


def stale_sample(lookup: Callable[[int], memoryview | None], dataset: Any, n: int, seed: int) -> int | None:
    """The first checked index whose published bytes differ from its sample in ``dataset`` now, or None.

    ``lookup(i)``: the published bytes of index ``i``, or None; each checked index is loaded and encoded as stored.

    Examples:
        >>> from ignite_ext.data.cache.codec import encode
        >>> from ignite_ext.data.cache.persist import stale_sample
        >>> def stored(values):
        ...     def lookup(i):
        ...         enc = encode(values[i])
        ...         buf = bytearray(enc.nbytes)
        ...         enc.write_into(memoryview(buf))
        ...         return memoryview(buf)
        ...     return lookup
        >>> stale_sample(stored(list("abcde")), list("abcde"), 5, seed=0) is None
        True
        >>> stale_sample(stored(list("abcde")), list("aBcde"), 5, seed=0)
        1

    .. versionadded:: 0.3.0
    """
    from ignite_ext.data.cache.codec import encode

    for index in checked_indices(n, lambda i: lookup(i) is not None, seed):
        raw = lookup(index)
        if raw is None:
            continue
        enc = encode(dataset[index])
        now = bytearray(enc.nbytes)
        enc.write_into(memoryview(now))
        if bytes(raw) != now:
            return index
    return None
