"""``python -m ignite_ext download``: fetch a file once per filesystem from a job prologue or a shell.

Building the parser imports little (``--help`` answers at once); the download machinery is imported when a download
runs. Made for job prologues: the path on stdout, one ``error:`` line on stderr and a documented exit status on
failure (never a traceback); while waiting for another process's fetch, a line on stderr every few seconds naming
the lock holder's host and pid, and one when the wait is over: the file was fetched by another process, or it
was not and this process fetches it (``--quiet`` silences them); a URL's first failed attempt, with why and the
retries to come, as a warning (``--verbose`` adds the next ones); progress bars only on a terminal.

.. versionadded:: 0.1.0
.. versionchanged:: 0.4.0
   A waiter says what it found ("fetched by another process"), not "took over"; failed attempts only with
   ``--verbose``.
.. versionchanged:: 0.5.0
   A URL's first failed attempt is a warning (shown by default and with ``--quiet``); ``--verbose`` adds the next.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from ignite_ext.data.download._job import LOW_SPEED_LIMIT, LOW_SPEED_TIME_S
from ignite_ext.data.download.extract import DEFAULT_MAX_TOTAL_BYTES

__all__ = ["EXIT_CHECKSUM", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_USAGE", "add_cli_arguments", "cli"]

#: Exit status: the download (or the extraction) failed.
EXIT_FAILED = 1
#: Exit status: bad arguments (argparse uses it too).
EXIT_USAGE = 2
#: Exit status: the bytes had another digest than expected, from every source.
EXIT_CHECKSUM = 3
#: Exit status: interrupted (128 + SIGINT).
EXIT_INTERRUPTED = 130


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``python -m ignite_ext download`` to ``parser``.

    Args:
        parser: the (sub)parser of the ``download`` command.

    Examples:
        >>> import argparse
        >>> from ignite_ext.data.download.cli import add_cli_arguments
        >>> parser = argparse.ArgumentParser()
        >>> add_cli_arguments(parser)
        >>> args = parser.parse_args(["https://example.org/a.tgz", "--root", "data", "--extract"])
        >>> args.url, args.root, args.extract, args.progress, args.log_level
        ('https://example.org/a.tgz', 'data', True, True, 20)

    .. versionadded:: 0.1.0
    """
    parser.add_argument("url", help="http, https or file URL")
    parser.add_argument("--root", required=True, help="directory to download into")
    parser.add_argument("--filename", help="file name in ROOT (default: from the URL)")
    parser.add_argument("--sha256", help="expected SHA-256, hex")
    parser.add_argument("--md5", help="expected MD5, hex")
    parser.add_argument("--mirror", action="append", default=[], dest="mirrors", help="another URL (repeatable)")
    parser.add_argument("--extract", action="store_true", help="extract the archive into ROOT/<stem>")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per connection or read (default: 30)")
    parser.add_argument("--retries", type=int, default=3, help="further attempts per URL (default: 3)")
    parser.add_argument("--deadline", type=float, help="give up fetching after this many seconds (default: none)")
    parser.add_argument(
        "--low-speed-limit",
        type=float,
        default=LOW_SPEED_LIMIT,
        help=f"give an attempt up when it stays below this many bytes/s (default: {LOW_SPEED_LIMIT}; 0: never)",
    )
    parser.add_argument(
        "--low-speed-time",
        type=float,
        default=LOW_SPEED_TIME_S,
        help=f"seconds an attempt may stay below --low-speed-limit (default: {LOW_SPEED_TIME_S:g})",
    )
    parser.add_argument(
        "--connections", type=int, default=1, help="concurrent range requests for a large file (default: 1)"
    )
    parser.add_argument(
        "--max-total-bytes",
        type=int,
        default=DEFAULT_MAX_TOTAL_BYTES,
        help="with --extract, refuse archives larger than this uncompressed (default: 1 TiB)",
    )
    parser.add_argument("--no-progress", action="store_false", dest="progress", help="no progress bar (only on a TTY)")
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument(
        "-q", "--quiet", action="store_const", const=logging.WARNING, dest="log_level", help="only warnings, errors"
    )
    talk.add_argument(
        "-v", "--verbose", action="store_const", const=logging.DEBUG, dest="log_level", help="every attempt, too"
    )
    parser.set_defaults(log_level=logging.INFO)


def cli(args: argparse.Namespace) -> int:
    """Run ``python -m ignite_ext download``: print the resulting path, or one error line on stderr.

    Args:
        args: parsed by a parser set up with :func:`add_cli_arguments`.

    Returns:
        0 on success; :data:`EXIT_FAILED` (1) when the download or the extraction failed, :data:`EXIT_USAGE` (2)
        for bad arguments (a malformed digest, an unsupported URL scheme), :data:`EXIT_CHECKSUM` (3) when every
        source served bytes with another digest, :data:`EXIT_INTERRUPTED` (130) on Ctrl-C.

    Examples:
        >>> import argparse, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data.download.cli import add_cli_arguments, cli
        >>> parser = argparse.ArgumentParser()
        >>> add_cli_arguments(parser)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     source = Path(tmp, "a.txt")
        ...     _ = source.write_text("a")
        ...     status = cli(parser.parse_args([source.as_uri(), "--root", tmp + "/out", "--no-progress"]))
        ...     print(status, Path(tmp, "out", "a.txt").read_text())  # doctest: +ELLIPSIS
        /.../out/a.txt
        0 a

    .. versionadded:: 0.1.0
    """
    from ignite_ext.data.download.fetch import download_url
    from ignite_ext.errors import ArchiveError, ChecksumError

    handler = _stderr_handler(getattr(args, "log_level", logging.INFO))
    try:
        path = download_url(
            args.url,
            args.root,
            args.filename,
            args.md5,
            sha256=args.sha256,
            mirrors=args.mirrors,
            extract=args.extract,
            timeout=args.timeout,
            retries=args.retries,
            deadline=getattr(args, "deadline", None),
            connections=getattr(args, "connections", 1),
            max_total_bytes=getattr(args, "max_total_bytes", DEFAULT_MAX_TOTAL_BYTES),
            progress=args.progress,
            low_speed_limit=getattr(args, "low_speed_limit", LOW_SPEED_LIMIT),
            low_speed_time=getattr(args, "low_speed_time", LOW_SPEED_TIME_S),
        )
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a job prologue wants one line to log and a status to branch on, never a traceback
        message = " ".join(str(exc).split())
        print(f"error: {type(exc).__name__}: {message}", file=sys.stderr)
        if isinstance(exc, ChecksumError):
            return EXIT_CHECKSUM
        if isinstance(exc, ValueError) and not isinstance(exc, ArchiveError):
            return EXIT_USAGE
        return EXIT_FAILED
    finally:
        _remove(handler)
    print(path)
    return 0


# What a job prologue's log shows: whom a process waits for, what it found after, a URL's first failed attempt (a
# warning), the next ones (-v).
_LOGGERS = ("ignite_ext.data.download", "ignite_ext.data.extract")


def _stderr_handler(level: int) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"ignite_ext download [{socket.gethostname()}:{os.getpid()}] %(message)s"))
    handler.setLevel(level)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(min(level, logger.level or logging.WARNING))
    return handler


def _remove(handler: logging.Handler) -> None:
    for name in _LOGGERS:
        logging.getLogger(name).removeHandler(handler)
