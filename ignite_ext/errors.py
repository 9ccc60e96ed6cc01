"""Every error the package raises, under one root: :class:`IgniteExtError`.

Each error also keeps the standard library base that code written before it already catches:
:class:`DownloadError` is a :class:`urllib.error.URLError` (so an :class:`OSError`), :class:`ChecksumError` also a
:class:`RuntimeError` (what torchvision raises for a wrong md5), :class:`ArchiveError` a :class:`ValueError`,
:class:`RankFailedError` and :class:`ShmSpaceError` are both :class:`RuntimeError`. So ``except IgniteExtError``
catches anything of this package, ``except OSError`` still catches a failed download, and a loop written for
torchvision's ``download_url`` (``except (RuntimeError, URLError)``, MNIST's over its mirrors) goes on to its next
mirror when :func:`ignite_ext.data.download_url` stands in for it.

Importing this module imports nothing heavy (no torch, no numpy).

.. code-block:: text

    IgniteExtError
    ├── RankFailedError (RuntimeError)       another rank's scheduled block failed, or it died
    │   ├── RankDiedError                    this rank, alive, was declared dead by the others
    │   └── StoreLostError                   the scheduler's store stopped answering
    ├── DownloadError (URLError, OSError)    a download failed
    │   └── ChecksumError (RuntimeError)     the bytes had another digest than expected
    ├── ArchiveError (ValueError)            an archive is unsafe, too large or unsupported
    └── ShmSpaceError (RuntimeError)         RAM (/dev/shm) or the disk_dir cannot hold a cache

Examples:
    >>> from ignite_ext.errors import DownloadError, IgniteExtError
    >>> err = DownloadError("https://example.org/x.bin: HTTP 404 Not Found", status=404)
    >>> isinstance(err, IgniteExtError), isinstance(err, OSError)
    (True, True)

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import textwrap
import urllib.error
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ArchiveError",
    "ChecksumError",
    "CollectiveError",
    "DownloadError",
    "IgniteExtError",
    "RankDiedError",
    "RankFailedError",
    "RankFailure",
    "RankStalledError",
    "ShmSpaceError",
    "StoreLostError",
    "rebuilt_error",
]


class IgniteExtError(Exception):
    """The base of every error this package raises.

    Examples:
        >>> from ignite_ext.errors import ArchiveError, IgniteExtError, RankFailedError
        >>> issubclass(ArchiveError, IgniteExtError), issubclass(RankFailedError, IgniteExtError)
        (True, True)

    .. versionadded:: 0.2.0
    """


@dataclass(frozen=True)
class RankFailure:
    """What one rank reported when its block failed, or what its peers saw when it died.

    Args:
        rank: global rank whose block raised (or that died).
        exc_type: qualified name of the exception type, e.g. ``"OSError"``; ``"RankDiedError"`` for a dead rank.
        message: ``str()`` of the exception, truncated to a few KiB; for a dead rank, how its death was noticed.
        died: True when the rank did not report at all: its heartbeat stopped (killed, lost with its node, hung).
        where: where the block raised: the innermost frames of the failing rank's traceback, formatted as Python
            prints them (empty for a dead rank). The waiting ranks usually exit first, so their error is the
            traceback a launcher shows: this is what tells the user where the first rank failed.

    Examples:
        >>> from ignite_ext.errors import RankFailure
        >>> str(RankFailure(0, "OSError", "disk full"))
        'rank 0: OSError: disk full'
        >>> str(RankFailure(3, "RankDiedError", "no heartbeat for 30 s", died=True))
        'rank 3 died: no heartbeat for 30 s'
        >>> print(RankFailure(0, "OSError", "disk full", where='  File "prepare.py", line 12, in fetch'))
        rank 0: OSError: disk full
          rank 0's traceback, innermost frames:
            File "prepare.py", line 12, in fetch

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.2.0
        ``died`` tells a dead rank from one whose block raised.
    .. versionchanged:: 0.4.0
        ``where``: the innermost frames of the failing rank's traceback.
    """

    rank: int
    exc_type: str
    message: str
    died: bool = False
    where: str = ""

    def __str__(self) -> str:
        if self.died:
            return f"rank {self.rank} died: {self.message}"
        text = f"rank {self.rank}: {self.exc_type}: {self.message}"
        if self.where:
            frames = "".join(f"  {line}\n" for line in self.where.rstrip("\n").split("\n"))
            text += f"\n  rank {self.rank}'s traceback, innermost frames:\n{frames.rstrip()}"
        return text


class RankFailedError(IgniteExtError, RuntimeError):
    """Raised on every rank that waited on (or ran before) a rank whose scheduled block failed.

    The failing rank itself re-raises its own exception; the others raise this error instead of running
    the block, so nobody runs a step that depended on a failed one and nobody hangs.

    Args:
        failures: one entry per failing rank, in rank order.
        context: what this rank was doing when it learnt of the failure.

    Attributes:
        failures: the :class:`RankFailure` entries, sorted by rank.
        ranks: the failing ranks, sorted.
        dead: the ranks among them that died (no report, heartbeat stopped), sorted.

    Examples:
        >>> from ignite_ext.errors import RankFailedError, RankFailure
        >>> err = RankFailedError([RankFailure(2, "OSError", "disk full")], "waiting for rank 2")
        >>> err.ranks, err.dead
        ((2,), ())
        >>> isinstance(err, RuntimeError)
        True

    .. versionadded:: 0.1.0
    """

    def __init__(self, failures: Iterable[RankFailure], context: str = "") -> None:
        self.failures: tuple[RankFailure, ...] = tuple(sorted(failures, key=lambda f: f.rank))
        self.ranks: tuple[int, ...] = tuple(f.rank for f in self.failures)
        self.dead: tuple[int, ...] = tuple(f.rank for f in self.failures if f.died)
        self.context = context
        super().__init__(self._message())

    def _message(self) -> str:
        details = [str(f) for f in self.failures]
        prefix = f"{self.context}: " if self.context else ""
        head = f"{prefix}rank(s) {list(self.ranks)} failed inside the scheduled block"
        if any("\n" in d for d in details):  # tracebacks: one indented paragraph per failure, as Python nests them
            return head + ":\n" + "\n".join(textwrap.indent(d, "  ") for d in details)
        return f"{head} ({'; '.join(details)})"

    def __reduce__(self) -> tuple[type[RankFailedError], tuple[tuple[RankFailure, ...], str]]:
        return type(self), (self.failures, self.context)


class RankStalledError(RankFailedError):
    """Raised on every rank of a scheduled block whose first rank's reported progress stopped advancing.

    A first rank that reports progress (:mod:`ignite_ext.progress`, and the package's downloads by themselves)
    and then reports no advance for the block's ``stall_timeout`` is alive but not getting anywhere: a read from
    a server that stopped sending, a lock a stranger holds, a hung mount. The ranks waiting for it raise this error
    in the same block instead of waiting for ever; so does the stalled rank, if it ever leaves the block.

    Attributes:
        stalled: the stalled ranks, sorted (the failures' messages say what they last reported, and when).

    Examples:
        >>> from ignite_ext.errors import RankFailedError, RankFailure, RankStalledError
        >>> stall = RankFailure(0, "RankStalledError", "no progress for 600 s; last: downloading a.bin: 45 %")
        >>> err = RankStalledError([stall], "rank 1 did not run the block")
        >>> err.stalled, isinstance(err, RankFailedError)
        ((0,), True)

    .. versionadded:: 0.4.0
    """

    def __init__(self, failures: Iterable[RankFailure], context: str = "") -> None:
        super().__init__(failures, context)
        self.stalled: tuple[int, ...] = tuple(f.rank for f in self.failures if f.exc_type == type(self).__name__)

    @staticmethod
    def among(failures: Iterable[RankFailure], context: str) -> RankFailedError:
        """The error for ``failures``: this one if a stall is among them, else :class:`RankFailedError`.

        Examples:
            >>> from ignite_ext.errors import RankFailure, RankStalledError
            >>> type(RankStalledError.among([RankFailure(2, "OSError", "disk full")], "")).__name__
            'RankFailedError'
        """
        failures = list(failures)
        if any(f.exc_type == RankStalledError.__name__ for f in failures):
            return RankStalledError(failures, context)
        return RankFailedError(failures, context)


class RankDiedError(RankFailedError):
    """Raised on a rank that is alive, but that the other ranks declared dead (its heartbeat stopped).

    The other ranks have already reported this rank as failed and gone on without it, so it must not carry on as if
    its block succeeded. Its process usually stood still for longer than the heartbeat timeout: paused (``SIGSTOP``
    or Ctrl-Z, a suspended job, ``gdb``), or cut off from the network.

    Examples:
        >>> from ignite_ext.errors import RankDiedError, RankFailedError, RankFailure
        >>> err = RankDiedError([RankFailure(1, "RankDiedError", "declared dead by its peers", died=True)], "rank 1")
        >>> isinstance(err, RankFailedError), err.dead
        (True, (1,))
        >>> print(err)  # doctest: +NORMALIZE_WHITESPACE
        rank 1: this rank is alive, but the other ranks declared it dead and went on without it: its heartbeat
        stopped for longer than IGNITE_EXT_HEARTBEAT_TIMEOUT (10 s by default). Its process was probably paused
        (SIGSTOP or Ctrl-Z, a suspended job, gdb) or cut off from the network. Restart the job; if such pauses are
        expected, raise IGNITE_EXT_HEARTBEAT_TIMEOUT.

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.6.0
        The message says that this rank is alive and was declared dead by the others.
    """

    def _message(self) -> str:
        prefix = f"{self.context}: " if self.context else ""
        return (
            f"{prefix}this rank is alive, but the other ranks declared it dead and went on without it: its "
            "heartbeat stopped for longer than IGNITE_EXT_HEARTBEAT_TIMEOUT (10 s by default). Its process was "
            "probably paused (SIGSTOP or Ctrl-Z, a suspended job, gdb) or cut off from the network. Restart the job; "
            "if such pauses are expected, raise IGNITE_EXT_HEARTBEAT_TIMEOUT."
        )


class StoreLostError(RankFailedError):
    """The store the scheduler waits through stopped answering (its host died, or the network to it is gone).

    No rank is named: whether the ranks are alive cannot be known without the store.

    Args:
        cause: what the store client reported.
        context: what this rank was doing.

    Examples:
        >>> from ignite_ext.errors import RankFailedError, StoreLostError
        >>> err = StoreLostError("Connection reset by peer", "rank 1 waiting for rank 0")
        >>> isinstance(err, RankFailedError), err.ranks
        (True, ())
        >>> print(err)
        rank 1 waiting for rank 0: lost the rendezvous store the scheduler waits through (Connection reset by peer)

    .. versionadded:: 0.2.0
    """

    def __init__(self, cause: str, context: str = "") -> None:
        self.cause = cause
        super().__init__((), context)

    def _message(self) -> str:
        prefix = f"{self.context}: " if self.context else ""
        return f"{prefix}lost the rendezvous store the scheduler waits through ({self.cause})"

    def __reduce__(self) -> tuple[type[StoreLostError], tuple[str, str]]:  # type: ignore[override]
        return type(self), (self.cause, self.context)


class CollectiveError(IgniteExtError, RuntimeError):
    """A collective of the scheduler (a policy's gathers, e.g. ``SharedPath``'s census) failed in the backend.

    Raised only when no rank was found dead within the detection time to explain it; when one was, the ranks raise
    :class:`RankFailedError` naming the dead instead. The backend's own error is its ``__cause__``.

    Examples:
        >>> from ignite_ext.errors import CollectiveError
        >>> issubclass(CollectiveError, RuntimeError)
        True

    .. versionadded:: 0.3.0
    """


class DownloadError(IgniteExtError, urllib.error.URLError):
    """A download failed: the server refused (404 and other 4xx), or every attempt on every URL failed.

    It is a :class:`urllib.error.URLError`, what ``urlopen`` and torchvision's ``download_url`` raise for the same
    failures, and so an :class:`OSError`: code that already catches either around a download keeps working, and
    a dataset's loop over its mirrors (torchvision's ``except (RuntimeError, URLError)``) goes on to the next one.
    Its ``str()`` is the message alone (not ``URLError``'s ``<urlopen error ...>``); ``reason`` is the message too.

    Args:
        message: one line naming the URL(s) and what went wrong.
        url: the URL of the last failure, if one.
        status: the HTTP status of the last failure, if one.

    Examples:
        >>> from urllib.error import URLError
        >>> from ignite_ext.data import DownloadError
        >>> err = DownloadError("https://example.org/x.bin: HTTP 404 Not Found", status=404)
        >>> isinstance(err, URLError), isinstance(err, OSError), err.status
        (True, True, 404)
        >>> print(err)
        https://example.org/x.bin: HTTP 404 Not Found

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.4.0
        A :class:`urllib.error.URLError` (it was a plain :class:`OSError`), so that it can stand in for torchvision's
        errors.
    """

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status

    def __str__(self) -> str:
        return OSError.__str__(self)  # the message (with "[Errno n]" when one is set), not "<urlopen error ...>"


class ChecksumError(DownloadError, RuntimeError):
    """The downloaded bytes do not have the expected digest; nothing was published.

    Also a :class:`RuntimeError`, what torchvision's ``download_url`` raises for a wrong md5.

    Args:
        message: one line naming the URL, the algorithm, the expected and the actual digest.
        algorithm: ``"sha256"`` or ``"md5"``.
        expected: the digest that was asked for.
        actual: the digest of what was received.
        url: where the bytes came from.

    Examples:
        >>> from ignite_ext.data import ChecksumError, DownloadError
        >>> err = ChecksumError("x: sha256 mismatch", algorithm="sha256", expected="ab", actual="cd")
        >>> isinstance(err, DownloadError), isinstance(err, RuntimeError), err.expected, err.actual
        (True, True, 'ab', 'cd')

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.4.0
        Also a :class:`RuntimeError`, so that it can stand in for torchvision's error.
    """

    def __init__(
        self, message: str, *, algorithm: str = "", expected: str = "", actual: str = "", url: str | None = None
    ) -> None:
        super().__init__(message, url=url)
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual


class ArchiveError(IgniteExtError, ValueError):
    """An archive is unsafe to extract, too large, or not of a supported type; nothing was extracted.

    Examples:
        >>> from ignite_ext.data import ArchiveError
        >>> issubclass(ArchiveError, ValueError)
        True

    .. versionadded:: 0.1.0
    """


class ShmSpaceError(IgniteExtError, RuntimeError):
    """The cache does not fit: RAM in ``/dev/shm``, or the ``disk_dir`` of its disk tier, lacks room.

    The message says which of the two is full, how many bytes are free and what to do.

    Examples:
        >>> from ignite_ext.errors import ShmSpaceError
        >>> issubclass(ShmSpaceError, RuntimeError)
        True

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.6.0
        The message names the place that is full: RAM in ``/dev/shm`` or the disk directory.
    """


# The package's errors that keep their type when they travel between ranks by name and message (see rebuilt_error):
# each can be made from its message alone.
_REBUILDABLE: dict[str, type[IgniteExtError]] = {
    f"{cls.__module__}.{cls.__qualname__}": cls for cls in (ArchiveError, ChecksumError, DownloadError, ShmSpaceError)
}


def rebuilt_error(name: str, message: str) -> IgniteExtError | None:
    """The package's error called ``name`` (``module.QualName``) made anew from ``message``, or None if none is.

    How an error raised on one rank is raised with its own type on the others (:func:`ignite_ext.distributed.agree`),
    without the distributed layer knowing the data layer's errors: they travel by name and message.

    Examples:
        >>> from ignite_ext.errors import rebuilt_error
        >>> rebuilt_error("ignite_ext.errors.ShmSpaceError", "no room")
        ShmSpaceError('no room')
        >>> rebuilt_error("builtins.KeyError", "x") is None
        True

    .. versionadded:: 0.3.0
    """
    cls = _REBUILDABLE.get(name)
    return None if cls is None else cls(message)
