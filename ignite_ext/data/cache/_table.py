"""An arena's sample table: one entry per dataset index, published when complete, read without a lock.

*Publish when complete*: a writer reserves a range (under the lock, where :mod:`~ignite_ext.data.cache._space`
says), copies the sample into it (no lock) and then, under the lock, writes offset and length and flips the entry
to ``READY`` last. Readers never lock: a ``READY`` entry is complete. A writer killed before it publishes leaves an
``EMPTY`` entry, never a half one; a second writer of an entry finds it taken at publish time. How an entry is read
(a view, or a copy checked against evictions) and lent is the space policy's to say.

.. versionadded:: 0.5.0
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ignite_ext.data.cache._cow import CowMap
from ignite_ext.data.cache._mapping import EMPTY, ENTRY_WORDS, READY, Mapped, locked

__all__ = ["SampleTable"]


class SampleTable:
    """The table's operations, as methods of :class:`~ignite_ext.data.cache.arena.Arena` (which maps the file)."""

    def lookup(self: Mapped, index: int) -> memoryview | None:
        """Return the published bytes of ``index``, or ``None`` if it has none.

        A view into the arena; in a following arena, a private copy of the bytes, taken when no eviction happened
        during the copy (a range may be handed to another sample once evicted).
        """
        local = self._mapped()
        return local.space.read(local, index * ENTRY_WORDS)  # type: ignore[no-any-return]

    def holds(self: Mapped, index: int) -> bool:
        """Whether ``index`` has a published entry (without copying it, as :meth:`lookup` does in a following arena).

        .. versionadded:: 0.4.0
        """
        return bool(self._mapped().table[index * ENTRY_WORDS] == READY)

    def data_view(self: Mapped, offset: int, nbytes: int) -> memoryview:
        """A writable view of a reserved range."""
        return self._mapped().data[offset : offset + nbytes]

    def publish(self: Mapped, index: int, offset: int, nbytes: int) -> bool:
        """Make a fully written range the entry of ``index``; ``False`` if another writer published it first."""
        local = self._mapped()
        base = index * ENTRY_WORDS
        with locked(local):
            local.space.release(local, offset)
            if local.table[base] != EMPTY:
                return False
            local.table[base + 1] = offset
            local.table[base + 2] = nbytes
            local.table[base] = READY  # last: readers take READY to mean complete
        return True

    def borrow(self: Mapped, index: int, start: int, nbytes: int) -> memoryview | None:
        """A private, copy-on-write view of bytes ``start:start + nbytes`` of the published entry of ``index``.

        Writing to the view (or to a tensor built on it) copies the pages written, for this process only: the
        arena is never changed. ``None`` when the range is not page-aligned in the arena, is lent already (a
        tensor built on an earlier view of it is still alive in this process), the arena follows, or this kernel
        does not report the page flags this needs; then the caller copies. No other range that is ever lent may
        start in the range's last page (the codec and ``reserve`` start every lendable buffer on a page).
        """
        local = self._mapped()
        if not local.cow_opened:
            with local.thread_lock:
                if not local.cow_opened:
                    local.cow = CowMap.open(local.arena_fd)
                    local.cow_opened = True
        return local.space.lend(local, index * ENTRY_WORDS, start, nbytes)  # type: ignore[no-any-return]

    def lender(self: Mapped, index: int, raw: memoryview) -> Callable[[int, int], memoryview | None]:
        """What lends the large buffers of ``raw`` (the bytes :meth:`lookup` returned for ``index``) to a decoder.

        A private copy (a following arena's) lends slices of itself; a view of the arena, :meth:`borrow`.

        .. versionadded:: 0.4.0
        """
        if isinstance(raw.obj, bytearray):
            return lambda start, nbytes: raw[start : start + nbytes]
        return functools.partial(SampleTable.borrow, self, index)
