"""A real HTTP server on 127.0.0.1 for the download benchmark and tests, with counters and injectable faults.

It serves in-memory files, supports ``Range: bytes=N-`` with ``If-Range`` (ETag or Last-Modified), counts
requests and body bytes per path, and can misbehave per path: close the connection mid-body, stall, send
wrong bytes, answer a status (500, 429 with ``Retry-After``, 404) a number of times, or ignore ``Range``.
An optional throttle paces all bodies together, like one shared link; another paces each connection on its own,
like a server or CDN that limits every flow (where parallel ranges help).
"""

from __future__ import annotations

import dataclasses
import email.utils
import gzip
import hashlib
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlsplit

__all__ = ["Fault", "Request", "TestHTTPServer"]

_FLIP = bytes(range(256))[::-1]
_SEND_CHUNK = 64 * 1024


@dataclass
class Fault:
    """How one path misbehaves; ``times`` requests are affected (None: all of them)."""

    status: int | None = None
    retry_after: str | None = None
    drop_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 30.0
    wrong_bytes: bool = False
    ignore_range: bool = False
    times: int | None = None
    # Lies told to range requests (206 answers): another ETag, another total, "*" as the total, a range that ends at
    # range_end (short of the end of the file it announces), wrong bytes, or a status instead (416: "you have it all").
    range_etag: str | None = None
    range_total: int | None = None
    star_total: bool = False
    range_end: int | None = None
    range_wrong_bytes: bool = False
    range_status: int | None = None
    # A 206 even to a request without Range (as "bytes 0-"), so that the range lies above reach a plain GET too.
    always_206: bool = False
    # Other misbehaviour: a Content-Encoding (the body is gzip-compressed for "gzip"), a redirect, a slow body (at
    # trickle_bps, in writes of trickle_bytes: 1 byte at 1.25 B/s keeps every read of the client short).
    encoding: str | None = None
    redirect: str | None = None
    trickle_bps: float | None = None
    trickle_bytes: int = 1024


@dataclass
class Request:
    """What one request asked for and got."""

    path: str
    range: str | None
    if_range: str | None
    status: int = 0
    sent: int = 0


@dataclass
class _File:
    data: bytes
    etag: str | None
    last_modified: str | None


@dataclass
class _State:
    files: dict[str, _File] = field(default_factory=dict)
    faults: dict[str, Fault] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    throttle_bps: float | None = None
    next_slot: float = 0.0
    conn_bps: float | None = None


class TestHTTPServer:
    """``with TestHTTPServer() as server: url = server.add("/a.bin", data)``."""

    __test__ = False  # not a test class, despite the name

    def __init__(
        self, throttle_bps: float | None = None, conn_bps: float | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.state = _State(throttle_bps=throttle_bps, conn_bps=conn_bps)
        state = self.state

        class Handler(_Handler):
            pass

        Handler.state = state
        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def base(self) -> str:
        """``http://127.0.0.1:<port>``."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def url(self, path: str) -> str:
        """The URL of ``path`` on this server."""
        return self.base + path

    def add(
        self, path: str, data: bytes, *, etag: bool = True, last_modified: float | None = None, validators: bool = True
    ) -> str:
        """Serve ``data`` at ``path`` (replacing what was there, with new validators); return its URL."""
        tag = f'"{hashlib.sha256(data).hexdigest()[:16]}"' if etag and validators else None
        modified = email.utils.formatdate(last_modified or time.time(), usegmt=True) if validators else None
        with self.state.lock:
            self.state.files[path] = _File(data, tag, modified)
        return self.url(path)

    def fault(self, path: str, **kwargs: object) -> None:
        """Make ``path`` misbehave as the :class:`Fault` fields given say."""
        with self.state.lock:
            self.state.faults[path] = Fault(**kwargs)  # type: ignore[arg-type]

    def clear_fault(self, path: str) -> None:
        """Serve ``path`` normally again."""
        with self.state.lock:
            self.state.faults.pop(path, None)

    def set_throttle(self, bps: float | None) -> None:
        """Pace all bodies together at ``bps`` bytes per second (None: no limit)."""
        with self.state.lock:
            self.state.throttle_bps = bps

    def requests(self, path: str) -> list[Request]:
        """The requests made for ``path`` so far."""
        with self.state.lock:
            return [r for r in self.state.log if r.path == path]

    def bytes_served(self, path: str) -> int:
        """Body bytes sent for ``path`` so far."""
        return sum(r.sent for r in self.requests(path))

    def counts(self) -> Counter[str]:
        """Requests per path so far."""
        with self.state.lock:
            return Counter(r.path for r in self.state.log)

    def close(self) -> None:
        """Stop serving and release stalled handlers."""
        self.state.stop.set()  # releases stalled handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> TestHTTPServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    state: _State
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        request = Request(path, self.headers.get("Range"), self.headers.get("If-Range"))
        state = self.state
        with state.lock:
            state.log.append(request)
            file = state.files.get(path)
            fault = self._take_fault(path)
        if fault.redirect is not None:
            request.status = 302
            self.send_response(302)
            self.send_header("Location", fault.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif file is None:
            self._status(request, 404)
        elif fault.range_status is not None and request.range is not None:
            request.status = fault.range_status
            self.send_response(fault.range_status)
            start = re.fullmatch(r"bytes=(\d+)-", request.range)
            self.send_header("Content-Range", f"bytes */{start.group(1) if start else 0}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif fault.status is not None:
            self._status(request, fault.status, fault.retry_after)
        else:
            self._body(request, file, fault)

    def _take_fault(self, path: str) -> Fault:
        fault = self.state.faults.get(path)
        if fault is None:
            return Fault()
        if fault.times is not None:
            fault.times -= 1
            if fault.times <= 0:
                del self.state.faults[path]
        return fault

    def _status(self, request: Request, status: int, retry_after: str | None = None) -> None:
        request.status = status
        self.send_response(status)
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _start(self, request: Request, file: _File, fault: Fault) -> int | None:
        """Where the body starts (None: answered 416)."""
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", request.range or "")
        if match is None or fault.ignore_range:
            return 0
        if request.if_range is not None and request.if_range not in (file.etag, file.last_modified):
            return 0
        start = int(match.group(1))
        if start >= len(file.data):
            request.status = 416
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(file.data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return start

    def _body(self, request: Request, file: _File, fault: Fault) -> None:
        start = self._start(request, file, fault)
        if start is None:
            return
        data = file.data
        ranged = bool(start) or fault.always_206
        request.status = 206 if ranged else 200
        last = re.fullmatch(r"bytes=\d+-(\d+)", request.range or "") if start else None
        stop = min(len(data), int(last.group(1)) + 1) if last else len(data)
        if ranged and fault.range_end is not None:
            stop = min(stop, fault.range_end)
        body = data[start:stop]
        if fault.encoding == "gzip":
            body = gzip.compress(body)
        self.send_response(request.status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        etag = fault.range_etag if ranged and fault.range_etag is not None else file.etag
        if etag:
            self.send_header("ETag", etag)
        if file.last_modified:
            self.send_header("Last-Modified", file.last_modified)
        if fault.encoding is not None:
            self.send_header("Content-Encoding", fault.encoding)
        if ranged:
            total = "*" if fault.star_total else str(fault.range_total or len(data))
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{total}")
        self.end_headers()
        if start and fault.range_wrong_bytes:
            fault = dataclasses.replace(fault, wrong_bytes=True)
        view = memoryview(body)
        try:
            self._send(request, view, fault)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _send(self, request: Request, view: memoryview, fault: Fault) -> None:
        stalled = False
        while view:
            n = min(_SEND_CHUNK, len(view))
            if fault.drop_after is not None:
                n = min(n, fault.drop_after - request.sent)
                if n <= 0:
                    self.close_connection = True
                    return
            if fault.stall_after is not None and not stalled:
                if request.sent >= fault.stall_after:
                    stalled = True
                    self.wfile.flush()
                    if self.state.stop.wait(fault.stall_s):
                        return
                    continue
                n = min(n, fault.stall_after - request.sent)
            chunk = bytes(view[:n])
            if fault.wrong_bytes:
                chunk = chunk.translate(_FLIP)
            self._pace(n)
            if self.state.conn_bps:  # each connection its own link of conn_bps, as a per-flow limited CDN
                time.sleep(n / self.state.conn_bps)
            if fault.trickle_bps:
                n = min(n, fault.trickle_bytes)
                chunk = chunk[:n]
                if self.state.stop.wait(n / fault.trickle_bps):  # a closed server releases its trickles too
                    self.close_connection = True
                    return
            self.wfile.write(chunk)
            self.wfile.flush()
            with self.state.lock:
                request.sent += n
            view = view[n:]

    def _pace(self, n: int) -> None:
        """Share one link of ``throttle_bps`` among all bodies being sent."""
        with self.state.lock:
            bps = self.state.throttle_bps
            if not bps:
                return
            now = time.monotonic()
            slot = max(now, self.state.next_slot)
            self.state.next_slot = slot + n / bps
        delay = slot + n / bps - now
        if delay > 0:
            time.sleep(delay)
