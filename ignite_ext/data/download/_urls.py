"""URLs on the wire: non-ASCII encoded, redirects followed only to ``http``/``https``, and strong dates.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import email.utils
import http.client
import urllib.parse
import urllib.request
from typing import IO

from ignite_ext.errors import IgniteExtError

__all__ = ["OPENER", "RedirectRefused", "SafeRedirects", "as_uri", "strong_date"]


class RedirectRefused(IgniteExtError):
    """A redirect to a scheme other than ``http`` and ``https``; not retried.

    Args:
        message: what was refused, naming both URLs.
        status: the redirect's HTTP status.

    .. versionadded:: 0.2.0
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SafeRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects only to ``http`` and ``https`` (urllib would follow one to ``ftp``)."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme and scheme not in ("http", "https"):
            raise RedirectRefused(f"{req.full_url}: redirected to {newurl!r}, a scheme that is not http or https", code)
        return super().redirect_request(req, fp, code, msg, headers, as_uri(newurl))


OPENER = urllib.request.build_opener(SafeRedirects)


def as_uri(url: str) -> str:
    """``url`` with a non-ASCII host in IDNA and non-ASCII path, query and fragment percent-encoded (UTF-8).

    Examples:
        >>> from ignite_ext.data.download._urls import as_uri
        >>> as_uri("https://exämple.org/données/ä b.bin?q=é")
        'https://xn--exmple-cua.org/donn%C3%A9es/%C3%A4%20b.bin?q=%C3%A9'
        >>> as_uri("https://example.org/a%20b.bin")  # already encoded: unchanged
        'https://example.org/a%20b.bin'

    .. versionadded:: 0.2.0
    """
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.hostname and not parts.hostname.isascii():
        netloc = netloc.replace(parts.hostname, parts.hostname.encode("idna").decode("ascii"))
    safe = "/:@!$&'()*+,;=%~-._"
    return urllib.parse.urlunsplit(
        (
            parts.scheme,
            netloc,
            urllib.parse.quote(parts.path, safe=safe),
            urllib.parse.quote(parts.query, safe=safe + "?"),
            urllib.parse.quote(parts.fragment, safe=safe + "?"),
        )
    )


def strong_date(modified: str, date: str | None) -> bool:
    """Whether ``Last-Modified`` is at least a second before ``Date`` (when there is no Date, trust it)."""
    if date is None:
        return True
    try:
        return (
            email.utils.parsedate_to_datetime(date) - email.utils.parsedate_to_datetime(modified)
        ).total_seconds() >= 1
    except (TypeError, ValueError):
        return False
