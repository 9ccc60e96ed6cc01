"""HTTP side of :func:`ignite_ext.data.download_url`: conditional range requests and the retry policy.

Only the standard library is used (:mod:`urllib.request`), so ``http``, ``https`` and ``file`` URLs work
wherever Python does, proxies and redirects included. This module knows nothing about files on disk:
:mod:`ignite_ext.data.download.fetch` decides where the bytes go.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import email.utils
import http.client
import random
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import Message
from typing import IO

from ignite_ext.data.download._urls import OPENER, RedirectRefused, as_uri, strong_date
from ignite_ext.errors import IgniteExtError
from ignite_ext.settings import DOWNLOAD_BACKOFF_S

__all__ = [
    "BACKOFF_BASE_S",
    "BACKOFF_ENV",
    "RETRY_AFTER_MAX_S",
    "SCHEMES",
    "FatalHTTPError",
    "LengthConflict",
    "RangeMismatch",
    "Response",
    "RetryableError",
    "SpeedFloor",
    "TooSlow",
    "Validator",
    "backoff_delay",
    "check_scheme",
    "open_range",
]

#: URL schemes :func:`ignite_ext.data.download_url` accepts.
SCHEMES = ("http", "https", "file")
#: Base of the exponential backoff between attempts, in seconds (overridden by :data:`BACKOFF_ENV`).
BACKOFF_BASE_S: float = DOWNLOAD_BACKOFF_S.default
#: Environment variable that overrides :data:`BACKOFF_BASE_S`, e.g. ``0.01`` in tests (see :doc:`/settings`).
BACKOFF_ENV = DOWNLOAD_BACKOFF_S.name
#: A ``Retry-After`` up to this many seconds is honoured; a longer one falls back to the backoff.
RETRY_AFTER_MAX_S = 60.0

_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)", re.IGNORECASE)
_UNSATISFIED_RANGE = re.compile(r"bytes\s+\*/(\d+)", re.IGNORECASE)
_USER_AGENT = "ignite_ext-download"


class RetryableError(IgniteExtError):
    """A transient failure (connection, timeout, short body, 5xx, 429): the same URL may work later.

    Args:
        message: what went wrong, naming the URL.
        retry_after: the server's ``Retry-After`` in seconds, when it sent a usable one.

    Examples:
        >>> from ignite_ext.data.download._http import RetryableError
        >>> RetryableError("http://host/a: HTTP 503", retry_after=2.0).retry_after
        2.0

    .. versionadded:: 0.1.0
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RangeMismatch(RetryableError):
    """The answer to a range request cannot be trusted to continue the bytes held: start over without ``Range``.

    A 206 for another range, another version (``ETag``) or another total size than the bytes held, one that stops
    short of the end of the file when the rest of it was asked for, a 416, or a body cut short of the range it
    announced: appending it could splice two versions of the file, or pass part of the file off as all of it.

    Examples:
        >>> from ignite_ext.data.download._http import RangeMismatch, RetryableError
        >>> issubclass(RangeMismatch, RetryableError)
        True

    .. versionadded:: 0.2.0
    """


class TooSlow(RetryableError):
    """A body stayed below the low-speed floor for the whole window (see :class:`SpeedFloor`): given up, resumable.

    Examples:
        >>> from ignite_ext.data.download._http import RetryableError, TooSlow
        >>> issubclass(TooSlow, RetryableError)  # a failed attempt like a timeout: retried, from the bytes held
        True

    .. versionadded:: 0.3.0
    """


class SpeedFloor:
    """The low-speed abort of one response body, as curl's ``--speed-limit`` and ``--speed-time``.

    ``timeout`` bounds each read, so it cannot tell a server that trickles (a byte now and then, every read in
    time) from one that works: without a floor such a body keeps its caller for as long as the server likes. The
    bytes are counted in windows: a window closes as soon as it holds ``limit * seconds`` bytes and the next one
    opens, and a read that finds a window ``seconds`` old with fewer raises :class:`TooSlow`. Only reads check, and
    each comes within ``timeout`` (or fails), so a body is given up at most ``seconds + timeout`` after its window
    opened.

    Args:
        url: the URL, for the message.
        limit: the floor in bytes per second; 0 turns the check off.
        seconds: how long a body may stay below it.

    Examples:
        >>> import time
        >>> from ignite_ext.data.download._http import SpeedFloor, TooSlow
        >>> floor = SpeedFloor("http://host/a.bin", limit=1000, seconds=0.05)
        >>> floor.count(10)  # below the floor, but not for 0.05 s yet
        >>> time.sleep(0.06)
        >>> try:
        ...     floor.count(10)
        ... except TooSlow as exc:
        ...     print("given up:", "below 1000 B/s for 0.05 s" in str(exc))
        given up: True
        >>> SpeedFloor("http://host/a.bin", limit=0, seconds=0.05).count(0)  # off

    .. versionadded:: 0.3.0
    """

    def __init__(self, url: str, limit: float, seconds: float) -> None:
        self.url = url
        self.limit = limit
        self.seconds = seconds
        self._opened = time.monotonic()
        self._bytes = 0

    def count(self, n: int) -> None:
        """Count ``n`` bytes just read.

        Raises:
            TooSlow: the window is ``seconds`` old and holds fewer than ``limit * seconds`` bytes.
        """
        if self.limit <= 0:
            return
        self._bytes += n
        now = time.monotonic()
        if self._bytes >= self.limit * self.seconds:
            self._opened, self._bytes = now, 0
        elif now - self._opened >= self.seconds:
            raise TooSlow(
                f"{self.url}: below {self.limit:g} B/s for {self.seconds:g} s "
                f"({self._bytes} bytes in the last {now - self._opened:.1f} s)"
            )


class FatalHTTPError(IgniteExtError):
    """A failure that retrying the same URL cannot fix (404 and the other 4xx but 429).

    Args:
        message: what went wrong, naming the URL and the status.
        status: the HTTP status code.

    Examples:
        >>> from ignite_ext.data.download._http import FatalHTTPError
        >>> FatalHTTPError("http://host/a: HTTP 404 Not Found", 404).status
        404

    .. versionadded:: 0.1.0
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class LengthConflict(FatalHTTPError):
    """The server gave one strong ``ETag`` of the URL two lengths: it lies about one of them, and nothing says which.

    A strong validator names one sequence of bytes (RFC 9110 §8.8.3), so two lengths under one are not two versions
    of the file. Without a checksum to judge the bytes, nothing this URL serves is published, nor kept to resume.

    Examples:
        >>> from ignite_ext.data.download._http import FatalHTTPError, LengthConflict
        >>> issubclass(LengthConflict, FatalHTTPError)  # the URL's answer, not a transient failure: not retried
        True

    .. versionadded:: 0.4.0
    """


@dataclass(frozen=True)
class Validator:
    """What identifies one version of a remote file, so that a resumed range is known to belong to it.

    Attributes:
        etag: a strong ``ETag`` (weak ones cannot validate a range, RFC 9110 §13.1.5), or None.
        last_modified: the ``Last-Modified`` header, or None.

    Examples:
        >>> from email.message import Message
        >>> from ignite_ext.data.download._http import Validator
        >>> headers = Message()
        >>> headers["ETag"] = 'W/"weak"'
        >>> headers["Last-Modified"] = "Mon, 30 Nov 2026 08:00:00 GMT"
        >>> headers["Date"] = "Mon, 30 Nov 2026 09:00:00 GMT"
        >>> Validator.from_headers(headers).if_range  # a weak ETag cannot validate a range
        'Mon, 30 Nov 2026 08:00:00 GMT'
        >>> headers.replace_header("Date", "Mon, 30 Nov 2026 08:00:00 GMT")
        >>> Validator.from_headers(headers).if_range is None  # modified in the second it was sent: weak too
        True

    .. versionadded:: 0.1.0
    """

    etag: str | None = None
    last_modified: str | None = None

    @classmethod
    def from_headers(cls, headers: Message) -> Validator:
        """Read the validator of a response: a strong ``ETag``, and a ``Last-Modified`` only when it is strong.

        ``Last-Modified`` is weak (RFC 9110 §13.1.5) unless it is at least one second before the response's
        ``Date``: a file changed twice within that second would carry one date for two versions.
        """
        etag = headers.get("ETag")
        if etag is not None and etag.startswith("W/"):
            etag = None
        modified = headers.get("Last-Modified")
        if modified is not None and not strong_date(modified, headers.get("Date")):
            modified = None
        return cls(etag=etag, last_modified=modified)

    @property
    def if_range(self) -> str | None:
        """The ``If-Range`` value to send, or None when this version cannot be validated."""
        return self.etag or self.last_modified


@dataclass
class Response:
    """An open response body and what it means for the bytes already on disk.

    Attributes:
        body: the stream to read from (close it when done).
        offset: where the body starts in the file: the requested offset for a 206, 0 for a full body.
        total: the full size of the file, or None when the server did not say.
        validator: the version of the file this body belongs to.
        complete: True when the server says the bytes already held are the whole file (nothing to read).
        end: where the body must end in the file (a 206's announced range, or a full body's length), if known.
        ranges: whether the server serves byte ranges of this file (``Accept-Ranges: bytes``, or a 206).

    Examples:
        >>> import io
        >>> from ignite_ext.data.download._http import Response, Validator
        >>> Response(io.BytesIO(b"rest"), offset=10, total=14, validator=Validator(etag='"v1"')).complete
        False

    .. versionadded:: 0.1.0
    """

    body: IO[bytes]
    offset: int
    total: int | None
    validator: Validator
    complete: bool = False
    end: int | None = None
    ranges: bool = False


def check_scheme(url: str) -> None:
    """Raise :class:`ValueError` unless ``url`` is ``http``, ``https`` or ``file``.

    Args:
        url: the URL to check.

    Examples:
        >>> from ignite_ext.data.download._http import check_scheme
        >>> check_scheme("https://example.org/a.bin")
        >>> check_scheme("ftp://example.org/a.bin")
        Traceback (most recent call last):
        ...
        ValueError: unsupported URL scheme 'ftp' in 'ftp://example.org/a.bin'; expected one of http, https, file

    .. versionadded:: 0.1.0
    """
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unsupported URL scheme {scheme!r} in {url!r}; expected one of {', '.join(SCHEMES)}")
    if scheme != "file" and not parts.hostname:
        raise ValueError(f"no host in {url!r}")


def backoff_delay(attempt: int, retry_after: float | None = None) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): exponential with jitter.

    A small ``Retry-After`` wins over the backoff; a large one is not waited for (the backoff applies).

    Args:
        attempt: how many retries came before this one.
        retry_after: the server's ``Retry-After`` in seconds, if any.

    Examples:
        >>> from ignite_ext.data.download._http import backoff_delay
        >>> backoff_delay(3, retry_after=5.0)
        5.0
        >>> 8.0 <= backoff_delay(3) <= 9.0  # base 1 s: 1 * 2**3 plus up to 1 s of jitter
        True

    .. versionadded:: 0.1.0
    """
    if retry_after is not None and retry_after <= RETRY_AFTER_MAX_S:
        return retry_after
    base = DOWNLOAD_BACKOFF_S.read()
    # Jitter keeps the ranks of many jobs that failed together from retrying in lockstep.
    return base * 2.0**attempt + random.uniform(0, base)


def open_range(
    url: str,
    offset: int,
    validator: Validator | None,
    timeout: float,
    total: int | None = None,
    stop: int | None = None,
    lengths: Mapping[str, int] | None = None,
) -> Response:
    """Request ``url`` from byte ``offset`` on, valid only if the file is still ``validator``'s version.

    With ``offset == 0`` or no usable validator this is a plain GET. Otherwise it sends ``Range`` with
    ``If-Range``: a server that supports both answers 206 with the rest, and one that does not (or whose
    file changed) answers 200 with the whole file, which :attr:`Response.offset` reports as 0.

    Args:
        url: ``http``, ``https`` or ``file`` URL.
        offset: how many bytes of the file are already held.
        validator: the version those bytes belong to.
        timeout: seconds to wait for the connection and for each read.
        total: the file's size as an earlier response gave it, if known: a 206 claiming another is refused.
        stop: ask only for the bytes before this offset (one segment of a parallel fetch).
        lengths: the length each strong ``ETag`` of ``url`` was given earlier, if they are to be held to it.

    Returns:
        The open response; :attr:`Response.offset` says where its body starts.

    Raises:
        RangeMismatch: a resumed range that cannot continue the bytes held (see :class:`RangeMismatch`).
        RetryableError: connection errors, timeouts, 5xx and 429.
        LengthConflict: a response whose strong ``ETag`` is in ``lengths`` with another length.
        FatalHTTPError: the other 4xx, a redirect to a scheme other than ``http``/``https``, or a body in a
            ``Content-Encoding`` other than ``identity`` (its bytes are not the file's).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data.download._http import open_range
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     source = Path(tmp, "a.txt")
        ...     _ = source.write_bytes(b"hello")
        ...     response = open_range(source.as_uri(), 0, None, timeout=5)
        ...     with response.body:
        ...         print(response.offset, response.total, response.body.read())
        0 5 b'hello'

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.4.0
       ``lengths``: one strong ``ETag``, one length.
    """
    headers = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}
    resume = offset > 0 and validator is not None and validator.if_range is not None
    if resume:
        assert validator is not None and validator.if_range is not None
        headers["Range"] = f"bytes={offset}-" if stop is None else f"bytes={offset}-{stop - 1}"
        headers["If-Range"] = validator.if_range
    request = urllib.request.Request(as_uri(url), headers=headers)
    try:
        raw = OPENER.open(request, timeout=timeout)
    except RedirectRefused as exc:
        raise FatalHTTPError(str(exc), exc.status) from exc
    except urllib.error.HTTPError as exc:
        return _from_http_error(url, exc, offset if resume else 0)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        if _no_such_file(url, exc):  # a local file that is not there is a 404: asking again will not make it
            raise FatalHTTPError(f"{url}: {_reason(exc)}", 0) from exc
        raise RetryableError(f"{url}: {_reason(exc)}") from exc
    return _from_success(url, raw, offset if resume else 0, validator if resume else None, total, stop, lengths)


def _from_success(
    url: str,
    raw: IO[bytes],
    requested: int,
    sent: Validator | None,
    known_total: int | None,
    stop: int | None = None,
    lengths: Mapping[str, int] | None = None,
) -> Response:
    status = getattr(raw, "status", None) or 200  # file:// responses carry no status
    headers: Message = raw.headers  # type: ignore[attr-defined]
    validator = Validator.from_headers(headers)
    encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raw.close()
        if status == 206:
            raise RangeMismatch(f"{url}: a resumed range came with Content-Encoding {encoding!r}; starting over")
        raise FatalHTTPError(f"{url}: the server sent Content-Encoding {encoding!r} although identity was asked for", 0)
    if status == 206:
        match = _CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip())
        total = None if match is None or match.group(3) == "*" else int(match.group(3))
        _check_length(url, raw, lengths, validator, total)
        problem = _range_problem(match, requested, stop, sent, validator, total, known_total)
        if problem:
            raw.close()
            raise RangeMismatch(f"{url}: {problem}; starting over without Range")
        assert match is not None
        return Response(raw, requested, total, validator, end=int(match.group(2)) + 1, ranges=True)
    length = headers.get("Content-Length")
    size = int(length) if length and length.isdigit() else None
    _check_length(url, raw, lengths, validator, size)
    ranges = (headers.get("Accept-Ranges") or "").strip().lower() == "bytes"
    return Response(raw, 0, size, validator, end=size, ranges=ranges)


def _check_length(
    url: str, raw: IO[bytes], lengths: Mapping[str, int] | None, validator: Validator, total: int | None
) -> None:
    given = None if lengths is None or validator.etag is None else lengths.get(validator.etag)
    if given is not None and total is not None and total != given:
        raw.close()
        raise LengthConflict(
            f"{url}: the server gave ETag {validator.etag} to a file of {given} bytes and now to one of {total}; "
            "one of the two is a lie, and without a checksum nothing tells which: nothing was published",
            0,
        )


def _range_problem(
    match: re.Match[str] | None,
    requested: int,
    stop: int | None,
    sent: Validator | None,
    got: Validator,
    total: int | None,
    known_total: int | None,
) -> str:
    """Why a 206 cannot continue the bytes held, or "" when it can."""
    if match is None or int(match.group(1)) != requested or int(match.group(2)) < requested:
        return f"a 206 for another range than bytes={requested}-: {match.group(0) if match else None!r}"
    if sent is not None and sent.etag is not None and got.etag != sent.etag:
        return f"a 206 of version {got.etag} for bytes of version {sent.etag}"
    if sent is not None and sent.etag is None and got.last_modified not in (None, sent.last_modified):
        return f"a 206 of the version of {got.last_modified} for bytes of {sent.last_modified}"
    if total is not None and known_total is not None and total != known_total:
        return f"a 206 for a file of {total} bytes, but the bytes held are of one of {known_total}"
    end = int(match.group(2)) + 1
    if total is not None and end > total:
        return f"a 206 for bytes past the end of a file of {total} bytes"
    if stop is not None:
        return "" if end == stop else f"a 206 ending at byte {end - 1} for a segment ending at {stop - 1}"
    # The rest of the file was asked for: where the body ends, the file ends. A range that stops short of the size
    # the file is known to have would be taken for the whole of a smaller one (with "*" as its total, or no size
    # known, the range's end is all there is to go by).
    size = total if total is not None else known_total
    if size is not None and end != size:
        return f"a 206 ending at byte {end - 1} of a file of {size} bytes, for the rest of it from byte {requested}"
    return ""


def _from_http_error(url: str, exc: urllib.error.HTTPError, requested: int) -> Response:
    status = exc.code
    headers = exc.headers
    if status == 416 and requested:
        match = _UNSATISFIED_RANGE.fullmatch((headers.get("Content-Range") or "").strip())
        exc.close()
        if match is not None and int(match.group(1)) == requested:
            # The server says the bytes held are the whole file; only a checksum can confirm it (the caller's).
            return Response(exc, requested, requested, Validator.from_headers(headers), complete=True)
        raise RangeMismatch(f"{url}: HTTP 416 for a resumed range; starting over without Range")
    exc.close()
    if status == 429 or status >= 500:
        raise RetryableError(f"{url}: HTTP {status} {exc.reason}", _retry_after(headers))
    raise FatalHTTPError(f"{url}: HTTP {status} {exc.reason}", status)


def _retry_after(headers: Message | None) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _no_such_file(url: str, exc: BaseException) -> bool:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    missing = isinstance(reason, FileNotFoundError | NotADirectoryError | IsADirectoryError)
    return missing and urllib.parse.urlsplit(url).scheme == "file"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, str):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
