"""Copy-on-write views of a shared-memory file: zero-copy reads that the reader may modify without changing the file.

A process maps the cache file a second time, ``MAP_PRIVATE``: reading a page maps the file's own page, the first
write gives this process a private copy of it, which nobody else sees. A later read of the same bytes never sees an
earlier reader's changes: a range is lent to one holder at a time (while a view of it lives, the next read copies),
and before it is lent again the pages ``/proc/self/pagemap`` shows private (written) are dropped with
``MADV_DONTNEED``, mapping the file's pages again. That is safe only when no other lent range shares those pages:
lent ranges start on a page, and none starts in another's last page. Where ``pagemap`` does not report what this
needs (some sandboxes), nothing is lent and callers copy.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref

__all__ = ["PAGE", "CowMap"]

#: Lent ranges start and end on multiples of this.
PAGE = mmap.PAGESIZE

_PAGEMAP = "/proc/self/pagemap"
# Only the pages a reader writes take memory: the kernel need not commit the whole cache. Named from Python 3.13 on.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
# The top byte of a pagemap entry: bit 7 page present, bit 6 swapped, bit 5 file page (or shared anonymous).
_PRESENT, _SWAPPED, _FILE = 0x80, 0x40, 0x20
# Values of that byte for a page still equal to the file: not mapped yet, or mapping the file's page.
_CLEAN = bytes(b for b in range(256) if not b & _SWAPPED and (b & (_PRESENT | _FILE)) != _PRESENT)


class CowMap:
    """A private mapping of a file that lends page-aligned ranges as writable, copy-on-write memoryviews.

    Use :meth:`open`, which returns ``None`` where the kernel's page flags cannot be read.

    Examples:
        >>> import os, tempfile
        >>> from ignite_ext.data.cache._cow import PAGE, CowMap
        >>> fd, path = tempfile.mkstemp(dir="/dev/shm")
        >>> os.write(fd, b"a" * 2 * PAGE)
        8192
        >>> cow = CowMap.open(fd)
        >>> view = cow.lend(PAGE, PAGE)
        >>> view[:3] = b"xyz"  # a private copy of that page: the file is unchanged
        >>> os.pread(fd, 3, PAGE), cow.lend(PAGE, PAGE) is None  # lent once at a time
        (b'aaa', True)
        >>> del view
        >>> bytes(cow.lend(PAGE, PAGE)[:3])  # the written page was dropped: the file's bytes again
        b'aaa'
        >>> cow.close(); os.close(fd); os.unlink(path)

    .. versionadded:: 0.1.0
    """

    def __init__(self, mm: mmap.mmap, pagemap_fd: int) -> None:
        self._mm = mm
        self._view = memoryview(mm)
        anchor = ctypes.c_char.from_buffer(mm)
        self._first_page = ctypes.addressof(anchor) // PAGE
        del anchor  # it holds an export of the mapping, which would keep close() from unmapping it
        self._pagemap_fd = pagemap_fd
        self._lent: weakref.WeakValueDictionary[int, memoryview] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, fd: int) -> CowMap | None:
        """Map the file open as ``fd`` privately; ``None`` if page flags are unavailable or do not behave as needed.

        The check runs on the file's first page: read it (it must map the file's page), write it (it must become
        private) and drop it (it must be the file's again). Writes to the private mapping never reach the file.
        """
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                return None
            mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE | _MAP_NORESERVE, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return None
        try:
            pagemap_fd = os.open(_PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            mm.close()
            return None
        self = cls(mm, pagemap_fd)
        try:
            _ = self._view[0]
            mapped = self._flags(0, 1)[0] & (_PRESENT | _SWAPPED | _FILE) == _PRESENT | _FILE
            self._view[0] = self._view[0]
            written = self._dirty(0, PAGE)
            mm.madvise(mmap.MADV_DONTNEED, 0, PAGE)
            works = mapped and written and not self._dirty(0, PAGE)
        except (OSError, ValueError):
            works = False
        if not works:
            self.close()
            return None
        return self

    def _flags(self, first: int, count: int) -> bytes:
        """The top byte of the pagemap entry of each of ``count`` pages from page ``first`` of the mapping."""
        raw = os.pread(self._pagemap_fd, 8 * count, 8 * (self._first_page + first))
        return raw[7::8]  # entries are little-endian 64-bit words

    def _dirty(self, begin: int, end: int) -> bool:
        first = begin // PAGE
        return bool(self._flags(first, (end - 1) // PAGE - first + 1).translate(None, _CLEAN))

    def lend(self, begin: int, nbytes: int) -> memoryview | None:
        """A writable view of bytes ``begin:begin + nbytes`` of the file, or ``None`` if they cannot be lent now.

        ``None`` when ``begin`` is not page-aligned or the range is lent already. No other lendable range may
        start in this range's last page. The view must only be used to build tensors or
        arrays that hold it; the range is free again when the view is garbage-collected.
        """
        if begin % PAGE or nbytes <= 0 or begin + nbytes > len(self._view):
            return None
        end = begin + nbytes
        with self._lock:
            if begin in self._lent:
                return None
            if self._dirty(begin, end):
                self._mm.madvise(mmap.MADV_DONTNEED, begin, (end - begin + PAGE - 1) // PAGE * PAGE)
            view = self._view[begin:end]
            self._lent[begin] = view
        return view

    def close(self) -> None:
        """Unmap, unless views are still alive (then the mapping lives until they are gone)."""
        self._view.release()
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._pagemap_fd)
