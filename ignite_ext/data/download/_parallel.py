"""Parallel ranges: the rest of a file fetched over several connections into the writer's private temp file.

The response already open (a plain GET, or a resumed range) becomes segment 0 and goes on streaming through
:meth:`~ignite_ext.data.download._partial.Partial.append` (so the running digests stay sequential). The other
segments are fetched by threads, each with ``Range: bytes=a-b`` and ``If-Range`` (the version segment 0 came
with), written with ``pwrite`` at their offsets; each checks that its 206 is that range of that version and that
size, and resumes itself after a dropped connection. When every segment is complete their bytes are hashed in
order (read back, usually from the page cache), so verification is unchanged.

Only the contiguous prefix of the file counts as held: the temp file's record lists the segments and how far each
got, and a later writer that adopts the file after a crash keeps the longest complete prefix (a hole is never taken
for bytes). A server whose segment answers do not match (another version, another range or size) makes the whole
call fall back to one stream.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import IO

from ignite_ext.data.download._http import (
    RangeMismatch,
    RetryableError,
    SpeedFloor,
    Validator,
    backoff_delay,
    open_range,
)
from ignite_ext.data.download._partial import Partial, Segment
from ignite_ext.data.download._verify import CHUNK

__all__ = ["MIN_SEGMENT", "fetch_segments", "plan_segments"]

#: Smallest segment worth a connection of its own: below this, one stream is as fast.
MIN_SEGMENT = 4 << 20
# How often segment 0 writes how far every segment got into the temp file's record (for a resume after a crash).
_RECORD_EVERY_S = 1.0


def plan_segments(start: int, total: int, connections: int) -> list[Segment]:
    """Split bytes ``start:total`` into at most ``connections`` segments of at least :data:`MIN_SEGMENT` bytes.

    Examples:
        >>> from ignite_ext.data.download._parallel import MIN_SEGMENT, plan_segments
        >>> [(s.start, s.stop) for s in plan_segments(0, 4 * MIN_SEGMENT, 4)] == [
        ...     (i * MIN_SEGMENT, (i + 1) * MIN_SEGMENT) for i in range(4)]
        True
        >>> len(plan_segments(0, MIN_SEGMENT, 8))  # too small to split
        1

    .. versionadded:: 0.2.0
    """
    rest = total - start
    count = max(1, min(connections, rest // MIN_SEGMENT))
    bounds = [start + rest * i // count for i in range(count + 1)]
    return [Segment(a, b) for a, b in itertools.pairwise(bounds)]


def fetch_segments(
    url: str,
    partial: Partial,
    first: IO[bytes],
    segments: list[Segment],
    validator: Validator,
    *,
    timeout: float,
    retries: int,
    low_speed: tuple[float, float],
    on_bytes: Callable[[int], None],
    check_deadline: Callable[[], None],
) -> None:
    """Fetch ``segments`` (the first from the open body ``first``) into ``partial``; raise if any cannot be had.

    Each connection has a low-speed floor of its own (``low_speed``: bytes per second, seconds; see
    :class:`~ignite_ext.data.download._http.SpeedFloor`): one trickling segment is retried alone, while the others
    go on.

    Raises:
        RangeMismatch: a segment's answer does not continue this version of the file (the caller starts over in
            one stream).
        RetryableError: a segment failed ``retries + 1`` times, or the first stream failed once (timeout, short
            body, below the floor); the prefix fetched so far stays resumable.
    """
    total = segments[-1].stop
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def bytes_in(n: int) -> None:
        with lock:
            on_bytes(n)

    def run(segment: Segment) -> None:
        try:
            _fetch_one(
                url, partial, segment, validator, total, timeout, retries, low_speed, stop, bytes_in, check_deadline
            )
        except BaseException as exc:  # every thread's failure reaches the caller
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(s,), name="ignite_ext-range", daemon=True) for s in segments[1:]]
    partial.note_segments(segments)
    for thread in threads:
        thread.start()
    try:
        _stream_first(url, partial, first, segments, SpeedFloor(url, *low_speed), stop, bytes_in, check_deadline)
    except BaseException as exc:
        errors.append(exc)
        stop.set()
    for thread in threads:
        thread.join()
    if errors:
        # Only the contiguous prefix streamed by segment 0 is held: cut what lies beyond, so that nothing ever
        # takes the rest of the file (holes, stale bytes) for bytes of this version.
        os.ftruncate(partial.fd, partial.size)
        partial.note_segments(None)
        raise next((e for e in errors if isinstance(e, RangeMismatch)), errors[0])
    partial.absorb(segments[0].stop, total)


def _stream_first(
    url: str,
    partial: Partial,
    body: IO[bytes],
    segments: list[Segment],
    floor: SpeedFloor,
    stop: threading.Event,
    on_bytes: Callable[[int], None],
    check_deadline: Callable[[], None],
) -> None:
    first = segments[0]
    recorded = time.monotonic()
    while not first.complete and not stop.is_set():
        want = min(CHUNK, first.stop - first.start - first.done)
        try:
            chunk = body.read1(want)  # type: ignore[attr-defined]
        except Exception as exc:  # socket errors, timeouts: the prefix so far stays
            raise RetryableError(f"{url}: {type(exc).__name__}: {exc}") from exc
        if not chunk:
            raise RetryableError(f"{url}: connection closed after {partial.size} bytes of the first segment")
        partial.append(chunk)
        first.done += len(chunk)
        on_bytes(len(chunk))
        floor.count(len(chunk))
        check_deadline()
        if time.monotonic() - recorded > _RECORD_EVERY_S:
            partial.note_segments(segments)
            recorded = time.monotonic()


def _fetch_one(
    url: str,
    partial: Partial,
    segment: Segment,
    validator: Validator,
    total: int,
    timeout: float,
    retries: int,
    low_speed: tuple[float, float],
    stop: threading.Event,
    on_bytes: Callable[[int], None],
    check_deadline: Callable[[], None],
) -> None:
    failures = 0
    while not segment.complete and not stop.is_set():
        try:
            response = open_range(url, segment.start + segment.done, validator, timeout, total, stop=segment.stop)
            with contextlib.closing(response.body):
                if response.offset != segment.start + segment.done:
                    raise RangeMismatch(f"{url}: a segment request was answered with the whole file")
                floor = SpeedFloor(url, *low_speed)
                while not segment.complete and not stop.is_set():
                    try:
                        chunk = response.body.read1(CHUNK)  # type: ignore[attr-defined]
                    except Exception as exc:
                        raise RetryableError(f"{url}: {type(exc).__name__}: {exc}") from exc
                    if not chunk:
                        raise RetryableError(f"{url}: connection closed in bytes {segment.start}-{segment.stop - 1}")
                    chunk = chunk[: segment.stop - segment.start - segment.done]
                    _pwrite_all(partial.fd, chunk, segment.start + segment.done)
                    segment.done += len(chunk)
                    on_bytes(len(chunk))
                    floor.count(len(chunk))
                    check_deadline()
        except RangeMismatch:
            raise
        except RetryableError as exc:
            failures += 1
            if failures > retries:
                raise
            if stop.wait(backoff_delay(failures - 1, exc.retry_after)):
                return


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
