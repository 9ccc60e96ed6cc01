"""The shared-memory store behind :class:`~ignite_ext.data.CachedDataset`: one arena file per cache and tier.

Its rooms, put together here: the file's life (:mod:`~ignite_ext.data.cache._life`), the sample table
(:mod:`~ignite_ext.data.cache._table`), the space policy (:mod:`~ignite_ext.data.cache._space`: append only, or
following from the first :meth:`Arena.follow`) and the counters (:mod:`~ignite_ext.data.cache._counters`). Every
interleaving of their steps within a bound, with a SIGKILL at any step, is explored by
``tests/data/test_cache_interleavings.py``.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ignite_ext.data.cache._counters import Counters
from ignite_ext.data.cache._life import PERSIST_ROWS, PERSISTED, ArenaFile
from ignite_ext.data.cache._mapping import H_FOLLOW, aligned, locked
from ignite_ext.data.cache._space import Followed, Following
from ignite_ext.data.cache._table import SampleTable

__all__ = ["PERSISTED", "PERSIST_ROWS", "Arena", "Followed"]


class Arena(ArenaFile, SampleTable, Counters):
    """One cache's shared memory: the index table, the per-process counters and the data area.

    Create it once with :meth:`create` (in the process that owns the cache) and :meth:`attach` it anywhere else
    on the node.

    Examples:
        >>> from ignite_ext.data.cache.arena import Arena
        >>> arena = Arena.create(n=4, capacity=1 << 20)
        >>> offset = arena.reserve(0, 3)
        >>> arena.data_view(offset, 3)[:] = b"abc"
        >>> arena.publish(0, offset, 3)
        True
        >>> bytes(arena.lookup(0))
        b'abc'
        >>> arena.lookup(1) is None
        True
        >>> arena.close()

    .. versionadded:: 0.1.0
    """

    @property
    def following(self) -> bool:
        """Whether the arena follows a shard (:meth:`follow`): then it evicts, and :meth:`lookup` copies.

        .. versionadded:: 0.4.0
        """
        return bool(self._mapped().header[H_FOLLOW])

    def reserve(self, index: int, nbytes: int, page_offset: int | None = None) -> int | None:
        """Hand out ``nbytes`` of the data area for ``index``; ``None`` if it is already published or no room.

        The range starts at a multiple of 64 bytes or, with ``page_offset`` (a multiple of 64), ``page_offset``
        bytes before a page boundary of the file (see :attr:`~ignite_ext.data.cache.codec.Encoded.page_offset`).
        """
        local = self._mapped()
        return local.space.reserve(local, index, aligned(nbytes), page_offset)  # type: ignore[no-any-return]

    def abandon(self, offset: int) -> None:
        """Give up a range reserved at ``offset`` and not published (a following arena reuses it after an eviction).

        .. versionadded:: 0.4.0
        """
        local = self._mapped()
        with locked(local):
            local.space.release(local, offset)

    def follow(self, keep: Iterable[int] | Any) -> Followed:
        """Keep the entries of ``keep`` (indices) only: evict the others and hand their space to new samples.

        The first call makes the arena *following* (see :mod:`~ignite_ext.data.cache._space`), taking ``16 * n``
        bytes plus 10 KiB of the data area for bookkeeping (without room, nothing is evicted and ``following`` stays
        False). A call with the set of the call before costs no lock. Any process of the node may call it.

        Args:
            keep: the indices to keep (any iterable of ints, or an integer array).

        Raises:
            ValueError: an index is not in ``range(n)``.

        Examples:
            >>> from ignite_ext.data.cache.arena import Arena
            >>> arena = Arena.create(n=3, capacity=1 << 20)
            >>> arena.follow([0, 1, 2]).following
            True
            >>> for index in (0, 1):
            ...     offset = arena.reserve(index, 100)
            ...     arena.data_view(offset, 100)[:] = bytes([index]) * 100
            ...     arena.publish(index, offset, 100)
            True
            True
            >>> arena.follow([1, 2])  # index 0 left: evicted, its 128 bytes go to the next sample stored
            Followed(evicted=1, evicted_bytes=100, following=True)
            >>> arena.lookup(0) is None, arena.reserve(2, 100) == offset - 128
            (True, True)
            >>> arena.close()

        .. versionadded:: 0.4.0
        """
        return Following.follow(self._mapped(), keep)
