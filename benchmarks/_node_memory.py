"""What a group of processes and their data files take of a node's RAM: PSS plus the files' page cache outside it.

A process's proportional set size (PSS, ``/proc/PID/smaps_rollup``) counts each page it maps ``1/k`` when ``k``
processes map it, so summed over a group it is the RAM the group's mappings take, shared pages once. What it misses
is the page cache of files that are read with ``read()`` rather than mapped (LitData's chunks, Mosaic's shards):
those pages are RAM too, and a loader that reads its files every epoch needs them to stay. For each data file,
``mincore`` on a fresh mapping tells which of its pages are resident (mapping a file faults nothing in); the
resident pages that the group also maps (their PSS in its mappings of that file, less the private copies) are
already counted, the rest is added.

This needs nothing from the kernel but ``/proc`` and ``mincore``: no ``drop_caches`` (which would empty the page
cache of every other process of the node as well), and other processes' memory does not enter the measure.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Iterator

__all__ = ["PeakPss", "descendants", "group_memory", "pss", "resident_bytes"]

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def pss(pid: int) -> int:
    """Bytes of proportional set size of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _own_mapping(name: str) -> bool:
    """Whether a mapping holds a process's data (anonymous, heap, stack, shared memory), not a library's pages."""
    return name in ("[anon]", "[heap]", "[stack]") or name.startswith("/dev/shm/")


def smaps(pid: int) -> Iterator[tuple[str, str, int]]:
    """``(mapping, field, bytes)`` for each size field of each mapping of the process (``/proc/PID/smaps``).

    ``mapping`` is the mapped file's path, a name in brackets (``[heap]``, ``[stack]``) or ``[anon]``. Nothing when
    the process is gone.
    """
    name = "[anon]"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                parts = line.split()
                if parts and not parts[0].endswith(":"):
                    name = parts[5] if len(parts) > 5 else "[anon]"
                elif len(parts) == 3 and parts[2] == "kB":
                    yield name, parts[0][:-1], int(parts[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return


def data_memory(pid: int) -> dict[str, int]:
    """Bytes of the process's data mappings (anonymous, heap, stack, ``/dev/shm``): ``pss`` and ``private_dirty``.

    ``private_dirty`` is what of the anonymous memory and heap the process alone wrote. Libraries' pages are left
    out: their PSS depends on how many other processes of the machine map the same files. Zeros when the process
    is gone.
    """
    out = {"pss": 0, "private_dirty": 0}
    for name, field, size in smaps(pid):
        if field == "Pss" and _own_mapping(name):
            out["pss"] += size
        elif field == "Private_Dirty" and name in ("[anon]", "[heap]"):
            out["private_dirty"] += size
    return out


def private_dirty(pid: int) -> int:
    """Bytes of the process's anonymous mappings and heap that it alone holds, written (``Private_Dirty``).

    What a process costs beyond what it shares: a page it inherited at a fork and then wrote, or memory it
    allocated itself. 0 when the process is gone.
    """
    return data_memory(pid)["private_dirty"]


def descendants(pid: int) -> list[int]:
    """``pid``'s live descendants (its DataLoader workers, their children), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class PeakPss:
    """The peak, over the calls, of the PSS of ``roots`` and all their descendants, as a user's ``top`` sums it.

    Call it while the work runs (between two calls it sees nothing); ``peak`` is the largest sum seen, ``main``
    and ``children`` its split between the roots and their descendants at that moment.
    """

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)
        self.peak = self.main = self.children = 0
        self.samples = 0

    def __call__(self) -> None:
        main = sum(pss(pid) for pid in self.roots)
        children = sum(pss(child) for pid in self.roots for child in descendants(pid))
        self.samples += 1
        if main + children > self.peak:
            self.peak, self.main, self.children = main + children, main, children


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (or, for a tmpfs file, in RAM)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    pages = (size + _PAGE - 1) // _PAGE
    vec = ctypes.create_string_buffer(pages)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap failed on {path}")
        try:
            if _libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) * _PAGE


def _mapped_file_pss(paths: set[str], pids: Iterable[int]) -> dict[str, int]:
    """Per file, the PSS of the group's mappings of it, less their private (anonymous, copied-on-write) pages."""
    out = dict.fromkeys(paths, 0)
    for pid in pids:
        current: str | None = None
        pss_kb = anon_kb = 0
        try:
            with open(f"/proc/{pid}/smaps") as f:
                for line in f:
                    if not line[0].isupper():  # a mapping's first line: its address range, then its path
                        if current is not None:
                            out[current] += max(0, pss_kb - anon_kb) * 1024
                        parts = line.split(maxsplit=5)
                        current = parts[5].strip() if len(parts) == 6 and parts[5].strip() in paths else None
                        pss_kb = anon_kb = 0
                    elif current is not None and line.startswith("Pss:"):
                        pss_kb = int(line.split()[1])
                    elif current is not None and line.startswith("Anonymous:"):
                        anon_kb = int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if current is not None:
            out[current] += max(0, pss_kb - anon_kb) * 1024
    return out


def group_memory(pids: list[int], files: list[str]) -> dict[str, int]:
    """``pss`` (summed over ``pids``), ``page_cache`` (of ``files``, outside that PSS) and their ``total``."""
    total_pss = sum(pss(pid) for pid in pids)
    real = {os.path.realpath(f) for f in files}
    mapped = _mapped_file_pss(real, pids)
    outside = sum(max(0, resident_bytes(f) - mapped[f]) for f in real if os.path.exists(f))
    return {"pss": total_pss, "page_cache": outside, "total": total_pss + outside}
