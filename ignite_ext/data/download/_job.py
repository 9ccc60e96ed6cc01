"""What every attempt of one ``download_url`` call shares: its options and deadline, space checks, progress bars.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignite_ext import progress
from ignite_ext.errors import DownloadError

__all__ = [
    "LOW_SPEED_LIMIT",
    "LOW_SPEED_TIME_S",
    "DeadlinePassed",
    "Job",
    "NoBar",
    "NoSpace",
    "Reported",
    "check_space",
    "progress_bar",
]

#: Default low-speed floor of a download, in bytes per second (``low_speed_limit``; curl's ``--speed-limit``).
LOW_SPEED_LIMIT = 1024
#: Default time a body may stay below :data:`LOW_SPEED_LIMIT`, in seconds (``low_speed_time``; curl's
#: ``--speed-time``).
LOW_SPEED_TIME_S = 30.0


@dataclass(frozen=True)
class Job:
    """What every attempt of one call needs to know."""

    expected: Mapping[str, str]
    timeout: float
    retries: int
    progress: bool
    ends_at: float | None  # time.monotonic() past which this call gives up
    connections: int = 1
    low_speed_limit: float = LOW_SPEED_LIMIT  # bytes per second; 0: no floor
    low_speed_time: float = LOW_SPEED_TIME_S
    relay: bool = False  # join the file's relay chain in a scheduled block of a job

    def check_deadline(self, url: str) -> None:
        if self.ends_at is not None and time.monotonic() > self.ends_at:
            raise DeadlinePassed(f"{url}: gave up: the deadline passed")


class DeadlinePassed(DownloadError):
    """The call's ``deadline`` passed; not retried."""


def check_space(url: str, target: Path, needed: int) -> None:
    """Refuse up front a body the disk cannot hold (when its size is known)."""
    if needed <= 0:
        return
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return
    if needed > free:
        raise NoSpace(
            f"{url}: {target.parent} has {free} bytes free, but the file needs {needed} more; nothing was written",
            url=url,
        )


class NoSpace(DownloadError):
    """The disk cannot hold the file; not retried."""


class NoBar:
    """What the progress bar is where none is shown (tqdm is not even imported then)."""

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        """Nothing to show."""


class Reported:
    """A progress bar that also reports to the block's progress (:mod:`ignite_ext.progress`): what waiting ranks see.

    Finished when the body is in (a clean exit): checking and publishing it report nothing, and are not a stall.
    """

    def __init__(self, bar: Any, total: int | None, initial: int, label: str) -> None:
        self.bar, self.done = bar, initial
        progress.report(initial, total, what=f"downloading {label}", unit="B")

    def __enter__(self) -> Reported:
        self.bar.__enter__()
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.bar.__exit__(kind, *exc)
        if kind is None:
            progress.finish()

    def update(self, n: int) -> None:
        """``n`` more bytes are in."""
        self.bar.update(n)
        progress.advance(n)


def progress_bar(enabled: bool, total: int | None, initial: int, label: str) -> Any:
    """A tqdm bar on stderr if ``enabled`` and stderr is a terminal, else :class:`NoBar`; reported either way.

    A bar redraws itself with carriage returns: in a job log (a file or a pipe) they would run into the log lines.
    The bytes are reported to the block's progress (:class:`Reported`) whether a bar is shown or not.

    Examples:
        >>> import io, sys
        >>> from ignite_ext.data.download._job import NoBar, progress_bar
        >>> saved, sys.stderr = sys.stderr, io.StringIO()  # a job log: not a terminal
        >>> with progress_bar(True, 100, 0, "a.bin") as bar:
        ...     bar.update(100)
        >>> type(bar.bar).__name__, sys.stderr.getvalue()
        ('NoBar', '')
        >>> sys.stderr = None  # no stderr at all
        >>> isinstance(progress_bar(True, 100, 0, "a.bin").bar, NoBar)
        True
        >>> sys.stderr = saved
    """
    stream = sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (enabled and isatty is not None and isatty()):  # also no stderr at all (pythonw, some daemons)
        return Reported(NoBar(), total, initial, label)
    from tqdm.auto import tqdm  # only a process that shows a bar imports it

    bar = tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=label,
        leave=False,
        file=stream,  # the very stream found to be a terminal
    )
    return Reported(bar, total, initial, label)
