"""The progress board: where a process and its DataLoader workers record how far their work got.

One shared mapping, made when the package is imported (so that every worker forked after it writes to the same
pages), holds a slot per writer: slot 0 for the process's own threads, one per DataLoader worker after it. A slot
is a few numbers and a short text, written under a sequence lock (odd while a write is under way), so that a
reader never sees half a record and a writer never waits for a reader. Reading the board is reading memory.

Workers started by ``spawn`` or ``forkserver`` (the default from Python 3.14) inherit no mapping: on Linux the
board is an anonymous memory file (``memfd``: on no filesystem, gone with the last process that maps it; ``lsof``
lists it as ``/memfd:ignite_ext-progress (deleted)``), whose descriptor the process names in
``IGNITE_EXT_PROGRESS_BOARD`` (``<pid>:<fd>``); such a worker maps its rank's board through ``/proc/<pid>/fd/<fd>``
at its first report, when the name is its own rank's (``multiprocessing.parent_process``).

Standard library only (and :mod:`ignite_ext.settings`, which is too): the download helpers report here without
importing torch.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import math
import mmap
import multiprocessing
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass

from ignite_ext.settings import PROGRESS_BOARD

__all__ = ["ENV", "SLOTS", "Progress", "begin", "read", "write"]

#: Slots on the board: the process itself, then up to ``SLOTS - 1`` DataLoader workers (others share by id).
SLOTS = 65

# Each slot: a sequence number (odd while a write is under way), then the record: generation, done, total (NaN:
# unknown), done when the activity began, when it began and when it last advanced (CLOCK_MONOTONIC: one clock for
# every process of a host), finished, unit, what.
_SEQ = struct.Struct("<Q")
_DATA = struct.Struct("<QdddddB7s96s")
_SLOT_SIZE = _SEQ.size + _DATA.size
_HEADER = struct.Struct("<Q")  # the board's generation: a slot of another generation is an earlier block's
_SIZE = _HEADER.size + SLOTS * _SLOT_SIZE
_local = threading.Lock()  # the process's own threads share slot 0
#: Where a process names its board for the workers it starts without fork: ``<pid>:<fd>``.
ENV = PROGRESS_BOARD.name


def _new_board() -> tuple[mmap.mmap, int | None]:
    """A board for this process, shared with what it forks, and named for what it spawns where that is possible."""
    make = getattr(os, "memfd_create", None)
    if make is None:  # not Linux: workers not forked report unseen
        return mmap.mmap(-1, _SIZE), None
    fd = make("ignite_ext-progress", getattr(os, "MFD_CLOEXEC", 1))
    os.ftruncate(fd, _SIZE)
    os.environ[ENV] = f"{os.getpid()}:{fd}"  # the fd stays open: a spawned worker opens the board through it
    return mmap.mmap(fd, _SIZE), fd


_INHERITED = PROGRESS_BOARD.read()  # the starting process's board, as named before this one's replaces the name
_board, _fd = _new_board()
_OWNER = os.getpid()
_spawners: mmap.mmap | bool | None = None  # the rank's board in a worker it did not fork (False: unreachable)


@dataclass(frozen=True)
class Progress:
    """How far a rank's work in a scheduled block got, as its waiting peers see it.

    Args:
        what: what is being done (``"downloading mnist.tar.gz"``).
        done: how much is done, in ``unit``.
        total: how much there is to do, or None when unknown.
        rate: ``unit`` per second since the activity began, or None before a second report.
        since: seconds since it last advanced, when it was read.
        finished: whether the activity said it is over.
        unit: ``"B"`` for bytes (shown as kB, MB, GB), else the user's word (empty: items).

    Examples:
        >>> from ignite_ext.progress import Progress
        >>> print(Progress("downloading a.bin", 46_100_000, 102_400_000, 2_000_000.0, 0.5, False, "B"))
        downloading a.bin: 46.1 of 102.4 MB (45 %), 2.0 MB/s, about 28 s left
        >>> print(Progress("tokenizing", 120, None, 3.0, 1.0, False, ""))
        tokenizing: 120 done, 3/s

    .. versionadded:: 0.4.0
    """

    what: str
    done: float
    total: float | None
    rate: float | None
    since: float
    finished: bool
    unit: str = ""

    def __str__(self) -> str:
        amount = _amount(self.done, self.unit)
        if self.total is not None:
            share = 100.0 * self.done / self.total if self.total > 0 else 100.0
            text = f"{self.what}: {_amount(self.done, self.unit, self.total)} of {_amount(self.total, self.unit)}"
            text += f" ({share:.0f} %)"
        else:
            text = f"{self.what}: {amount} done"
        if self.finished:
            return text + ", finished"
        if self.rate is not None and self.rate > 0:
            text += f", {_amount(self.rate, self.unit)}/s"
            if self.total is not None and self.total > self.done:
                text += f", about {(self.total - self.done) / self.rate:.0f} s left"
        return text


def _amount(value: float, unit: str, scale_of: float | None = None) -> str:
    if unit != "B":
        number = f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
        return f"{number} {unit}".rstrip() if unit else number
    reference = value if scale_of is None else scale_of
    for factor, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if reference >= factor:
            scaled = f"{value / factor:.1f}"
            return scaled if scale_of is not None else f"{scaled} {name}"
    return f"{value:.0f}" if scale_of is not None else f"{value:.0f} B"


def _target() -> tuple[mmap.mmap, int]:
    """The board this writer writes to and its slot: the process's own 0, or its DataLoader worker's."""
    data = sys.modules.get("torch.utils.data")  # a worker of torch's DataLoader: torch is imported already
    info = data.get_worker_info() if data is not None else None
    if info is None and os.getpid() == _OWNER:
        return _board, 0
    slot = 1 + (info.id if info is not None else os.getpid()) % (SLOTS - 1)
    rank = _spawners_board() if info is not None else None
    if rank is not None:
        return rank, slot
    return (_board, 0) if os.getpid() == _OWNER else (_board, slot)


def _spawners_board() -> mmap.mmap | None:
    """The board of the process that started this DataLoader worker without forking it (spawn, forkserver)."""
    global _spawners
    if _spawners is None:
        _spawners = False
        parent = multiprocessing.parent_process()  # the rank, whichever the start method (the forkserver is not)
        if parent is not None and parent.pid != _OWNER:  # forked from the rank: its board is inherited
            for name in (_INHERITED, PROGRESS_BOARD.read()):
                pid, _, fd = (name or "").partition(":")
                if pid == str(parent.pid) and fd.isdigit():
                    try:
                        with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
                            if os.fstat(f.fileno()).st_size == _SIZE:
                                _spawners = mmap.mmap(f.fileno(), _SIZE)
                                break
                    except (OSError, ValueError):
                        continue
    return _spawners if isinstance(_spawners, mmap.mmap) else None


def _is_board(fd: int) -> bool:
    """Whether ``fd`` is still a board's (a process may have closed what it inherited, and reused the number)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ignite_ext-progress")
    except OSError:
        return False


def _generation(board: mmap.mmap | None = None) -> int:
    return int(_HEADER.unpack_from(_board if board is None else board, 0)[0])


def begin() -> None:
    """Start a block's record in this process: every slot written before is an earlier block's from now on.

    A process that did not make the board (a rank forked by its launcher after importing the package) makes its
    own first: ranks forked from one parent must not share one. The scheduler calls it as a body starts.

    Examples:
        >>> from ignite_ext import progress
        >>> progress.report(2, what="earlier work")
        >>> progress.begin()
        >>> progress.current() is None
        True

    .. versionadded:: 0.4.0
    """
    global _board, _fd, _OWNER
    with _local:
        if os.getpid() != _OWNER:
            if _fd is not None and _is_board(_fd):
                os.close(_fd)  # the parent's board, inherited: this process names its own from now on
            (_board, _fd), _OWNER = _new_board(), os.getpid()
        _HEADER.pack_into(_board, 0, _generation() + 1)


def write(done: float | None, total: float | None, what: str | None, unit: str | None, add: float, end: bool) -> None:
    """Update this writer's slot: set ``done`` (or add ``add`` to it), and what it is about; ``end``: finished.

    What :func:`~ignite_ext.progress.report`, :func:`~ignite_ext.progress.advance` and the others call. A new
    ``what`` (or the first write of a block) starts a new activity: its rate counts from there.

    Examples:
        >>> from ignite_ext.progress import board
        >>> board.begin()
        >>> board.write(10.0, 40.0, "hashing", "B", 0.0, False)
        >>> board.write(None, None, None, None, 10.0, False)
        >>> print(board.read())  # doctest: +ELLIPSIS
        hashing: 20 of 40 B (50 %)...

    .. versionadded:: 0.4.0
    """
    board, slot = _target()
    offset = _HEADER.size + slot * _SLOT_SIZE
    now = time.monotonic()
    with _local:
        (seq,) = _SEQ.unpack_from(board, offset)
        gen, was, whole, start_done, started, advanced, _, was_unit, was_what = _DATA.unpack_from(
            board, offset + _SEQ.size
        )
        generation = _generation(board)
        fresh = gen != generation or (what is not None and what.encode()[:96] != was_what.rstrip(b"\0"))
        if fresh:
            was, whole, was_unit, was_what = 0.0, math.nan, b"", b""
        value = (done if done is not None else was) + add
        if fresh:
            start_done, started, advanced = value, now, now
        elif value != was:
            advanced = now
        record = (
            generation,
            value,
            float(total) if total is not None else whole,
            start_done,
            started,
            advanced,
            1 if end else 0,
            unit.encode()[:7] if unit is not None else was_unit,
            what.encode()[:96] if what is not None else was_what,
        )
        _SEQ.pack_into(board, offset, seq + 1)  # odd: a reader of this slot now tries again
        _DATA.pack_into(board, offset + _SEQ.size, *record)
        _SEQ.pack_into(board, offset, seq + 2)


def read() -> Progress | None:
    """The block's progress, from every slot of this block: the latest activity's, and the newest advance.

    None when nothing was reported in this block. ``finished`` only when every activity said so; ``since`` counts
    from the newest advance of an unfinished activity (a worker that advances keeps its process from stalling).
    ``ignite_ext.progress.current`` is this function.

    Examples:
        >>> from ignite_ext import progress
        >>> progress.begin()
        >>> progress.report(1, total=4, what="tokenizing")
        >>> now = progress.current()
        >>> now.what, now.done, now.total, now.finished
        ('tokenizing', 1.0, 4.0, False)

    .. versionadded:: 0.4.0
    """
    now = time.monotonic()
    generation = _generation()
    latest: tuple[float, Progress] | None = None
    newest_open = -math.inf
    open_any = False
    for index in range(SLOTS):
        record = _read_slot(_HEADER.size + index * _SLOT_SIZE)
        if record is None or record[0] != generation:
            continue
        _, done, total, start_done, started, advanced, finished, unit, what = record
        rate = (done - start_done) / (advanced - started) if advanced - started > 0.05 else None
        progress = Progress(
            what.rstrip(b"\0").decode(errors="replace"),
            done,
            None if math.isnan(total) else total,
            rate,
            now - advanced,
            bool(finished),
            unit.rstrip(b"\0").decode(errors="replace"),
        )
        if not finished:
            open_any = True
            newest_open = max(newest_open, advanced)
        if latest is None or advanced > latest[0]:
            latest = (advanced, progress)
    if latest is None:
        return None
    shown = latest[1]
    since = now - newest_open if open_any else shown.since
    return Progress(shown.what, shown.done, shown.total, shown.rate, since, not open_any, shown.unit)


def _read_slot(offset: int) -> tuple[int, float, float, float, float, float, int, bytes, bytes] | None:
    for _ in range(100):
        (seq,) = _SEQ.unpack_from(_board, offset)
        record = _DATA.unpack_from(_board, offset + _SEQ.size)
        if seq % 2 == 0 and _SEQ.unpack_from(_board, offset)[0] == seq:
            return record if seq else None
    return None  # a writer that died in the middle of a write (a killed worker): its slot says nothing
