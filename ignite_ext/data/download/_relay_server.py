"""A holder's relay: serves the file it is writing, as it grows, to the other holders of the job, and to no one else.

:class:`Growing` is what the holder's temp file holds so far (its writer reports each byte kept, see
:class:`~ignite_ext.data.download._partial.Partial`); :class:`RelayServer` listens on the address the job's
process group uses, proves and checks the job's secret on every connection (:mod:`._relay_wire`), and streams
the one file it serves from the requested byte, with ``sendfile``, blocking while the bytes are still to come.
It serves nothing else: no other file, no listing, no write, whatever the request says.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from ignite_ext.data.download._relay_wire import HANDSHAKE_TIMEOUT_S, RelayRefused, send_message, server_hello

__all__ = ["MAX_CONNECTIONS", "Growing", "RelayServer", "Version"]

#: Connections a relay serves at once: a holder has one client, the one after it, and a few more when holders are
#: lost; a stranger opening connections by the thousand gets refused ones, and takes no thread.
MAX_CONNECTIONS = 16

logger = logging.getLogger("ignite_ext.data.download")


@dataclass(frozen=True)
class Version:
    """The version of the file the bytes belong to, as the origin named it, and its size.

    ``etag`` and ``last_modified`` are the origin's strong validator (either may be None); bytes of two sources
    are joined only when both name the same version, and one is named (else a resumed receiver starts over).

    .. versionadded:: 0.3.0
    """

    total: int
    etag: str | None
    last_modified: str | None

    @property
    def named(self) -> bool:
        return self.etag is not None or self.last_modified is not None


class Growing:
    """How many leading bytes of the file a holder has written, and which version they are of; waited on by relays.

    Examples:
        >>> from ignite_ext.data.download._relay_server import Growing, Version
        >>> g = Growing()
        >>> g.start(Version(10, '"v1"', None), fd=-1)
        >>> g.grew(4)
        >>> g.wait_beyond(0, g.generation, timeout=0)[0]
        4

    .. versionadded:: 0.3.0
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.version: Version | None = None
        self.prefix = 0
        self.generation = 0  # a new one each time the bytes start over: what a relay sent before is void
        self.ended = False  # no more bytes will come (complete, or given up)
        self.fd = -1  # a duplicate of the writer's descriptor: pread and sendfile from it survive rename and close

    def source(self, total: int, etag: str | None, last_modified: str | None, fd: int, size: int) -> None:
        """The writer's bytes are of this version; ``size`` of them are in ``fd`` (its ``Partial`` calls this)."""
        self.start(Version(total, etag, last_modified), fd, size)

    def start(self, version: Version, fd: int, prefix: int = 0) -> None:
        """The writer knows the version and holds ``prefix`` bytes of it in ``fd`` (duplicated here)."""
        with self._cond:
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = os.dup(fd) if fd >= 0 else -1
            if self.version != version or prefix < self.prefix:
                self.generation += 1
            self.version, self.prefix, self.ended = version, prefix, False
            self._cond.notify_all()

    def grew(self, prefix: int) -> None:
        with self._cond:
            self.prefix = prefix
            self._cond.notify_all()

    def restart(self) -> None:
        """The bytes start over (another version, or a bad splice): every stream of the old ones ends."""
        with self._cond:
            self.generation += 1
            self.prefix = 0
            self._cond.notify_all()

    def end(self) -> None:
        """No more bytes will come."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def duplicate(self) -> int:
        """A descriptor of the bytes of one's own (close it), or -1 once closed."""
        with self._cond:
            return os.dup(self.fd) if self.fd >= 0 else -1

    def close(self) -> None:
        with self._cond:
            self.ended = True
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self._cond.notify_all()

    def wait_known(self, timeout: float) -> tuple[Version | None, int, int, bool]:
        """``(version, prefix, generation, ended)`` once the version is known (or ended, or ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: self.version is not None or self.ended, timeout)
            return self.version, self.prefix, self.generation, self.ended

    def wait_beyond(self, offset: int, generation: int, timeout: float) -> tuple[int, int, bool]:
        """``(prefix, generation, ended)`` once the prefix passes ``offset``, the bytes restart, or they end."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.prefix > offset or self.generation != generation or self.ended, max(0.0, timeout)
            )
            return self.prefix, self.generation, self.ended


def _listen(host: str, ports: range) -> socket.socket:
    """A socket listening on ``host`` at the first free port of ``ports`` (``range(0, 1)``: any port).

    Raises:
        OSError: no port of ``ports`` is free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, port))
            listener.listen(64)
            return listener
        except OSError as exc:
            listener.close()
            if exc.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no free port in {ports.start}-{ports.stop - 1} on {host}")


class RelayServer:
    """Serves one :class:`Growing` file to clients that hold ``secret``, on ``host``, until :meth:`stop`.

    ``ports``: where it may listen (the first free one; ``range(0, 1)``, any port the system gives).

    Each connection gets a daemon thread; a client that stops reading for ``io_timeout`` seconds is dropped.

    .. versionadded:: 0.3.0
    """

    def __init__(
        self, growing: Growing, secret: bytes, file_id: str, host: str, io_timeout: float, ports: range = range(0, 1)
    ) -> None:
        self.growing, self._secret, self._file_id, self._io_timeout = growing, secret, file_id, io_timeout
        self._listener = _listen(host, ports)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self.served_bytes = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="ignite_ext-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and end every stream (the file itself stays)."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.growing.end()
        self._thread.join(timeout=5.0)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._stopped.is_set():
                    return
                logger.warning("relay: accept failed (%s); listening on", exc)  # EMFILE, ECONNABORTED: passing
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # as many connections as holders could want, and more: refused, not queued
                continue
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn,), name="ignite_ext-relay-stream", daemon=True).start()
            except RuntimeError:  # no thread to be had
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
                self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                request = server_hello(conn, self._secret, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            except RelayRefused as exc:
                self.refused += 1
                # The first one said loudly, the others quietly: a stranger at the port must not flood the log.
                (logger.warning if self.refused == 1 else logger.debug)("relay: refused a connection: %s", exc)
                return
            conn.settimeout(self._io_timeout)
            self._stream(conn, request)
        except OSError:
            pass  # the client went away, or stop() ended the stream: it resumes elsewhere
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _stream(self, conn: socket.socket, request: dict[str, object]) -> None:
        growing = self.growing
        if request.get("file") != self._file_id:
            send_message(conn, {"error": "no such file"})
            return
        version, prefix, generation, ended = growing.wait_known(self._io_timeout)
        while version is None and not ended and not self._stopped.is_set():  # its holder still waits for the origin
            version, prefix, generation, ended = growing.wait_known(self._io_timeout)
        if version is None:
            send_message(conn, {"error": "the file is not coming"})
            return
        asked = request.get("offset")
        same = version.named and [request.get("etag"), request.get("last_modified")] == [
            version.etag,
            version.last_modified,
        ]
        offset = asked if same and isinstance(asked, int) and 0 <= asked <= version.total else 0
        send_message(
            conn,
            {"total": version.total, "etag": version.etag, "last_modified": version.last_modified, "offset": offset},
        )
        while offset < version.total and not self._stopped.is_set():
            prefix, now, ended = growing.wait_beyond(offset, generation, self._io_timeout)
            if now != generation:
                return  # the bytes started over: the client asks again
            if prefix > offset:
                sent = self._send(conn, offset, prefix - offset)
                offset += sent
                self.served_bytes += sent
            elif ended:
                return  # given up short of the end: the client resumes elsewhere

    def _send(self, conn: socket.socket, offset: int, count: int) -> int:
        """Send bytes ``offset:offset + count`` of the file; within ``io_timeout`` of each other.

        ``os.sendfile`` with an explicit offset, never a file object: the descriptor is a duplicate of the writer's,
        whose file offset a file object's seek or read would move under the writer's next write.
        """
        fd = self.growing.duplicate()
        if fd < 0:
            raise OSError("the file is closed")
        try:
            sent = 0
            with selectors.DefaultSelector() as selector:
                selector.register(conn, selectors.EVENT_WRITE)
                while sent < count:
                    if not selector.select(self._io_timeout):
                        raise TimeoutError(f"the client read nothing for {self._io_timeout:.0f} s")
                    try:
                        n = os.sendfile(conn.fileno(), fd, offset + sent, count - sent)
                    except BlockingIOError:
                        continue
                    if n == 0:
                        raise OSError(f"the file ends before byte {offset + sent + 1}, which it was said to hold")
                    sent += n
            return sent
        finally:
            os.close(fd)
