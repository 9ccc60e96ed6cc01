"""The relay's wire: a mutual proof of the job's secret, then one request and one answer, both length-prefixed JSON.

A connection to a relay goes:

1. the client sends 16 random bytes (its nonce);
2. the server sends 16 random bytes and ``HMAC-SHA256(secret, "S" + client nonce + server nonce)``: a port that
   does not know the secret (another user's process that took the port over) is refused here, before any byte;
3. the client sends ``HMAC-SHA256(secret, "C" + server nonce + request)`` and the request: which file, from which
   byte, for which version; a client without the secret is refused here and learns nothing but a closed socket;
4. the server answers with what it knows of the file (its size and version), then streams the bytes.

The secret never travels: each side proves it holds it on the other's fresh nonce, so a recorded exchange cannot
be replayed. The bytes themselves are not authenticated: whatever arrives is checked against the file's digest
before it is published.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from typing import Any

from ignite_ext.errors import IgniteExtError

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "NONCE",
    "RelayRefused",
    "client_hello",
    "read_message",
    "send_message",
    "server_hello",
]

NONCE = 16
#: Seconds either side has to connect, prove the secret and send its request or answer.
HANDSHAKE_TIMEOUT_S = 10.0
_MAC = hashlib.sha256().digest_size
_LEN = struct.Struct(">I")
#: A request or an answer is a few hundred bytes: anything longer is not one.
_MAX_MESSAGE = 64 << 10


class RelayRefused(IgniteExtError, ConnectionError):
    """The other end did not prove that it holds the job's secret, or broke the protocol (never leaves the relay).

    .. versionadded:: 0.3.0
    """


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; by ``deadline`` (``time.monotonic()``) if given, however slowly they trickle in."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the other end took too long")
            sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"the connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send ``message`` as length-prefixed JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def read_message(sock: socket.socket) -> dict[str, Any]:
    """Read one length-prefixed JSON object.

    Raises:
        RelayRefused: not a JSON object of a sane length.
    """
    (length,) = _LEN.unpack(_read_exactly(sock, _LEN.size))
    if length > _MAX_MESSAGE:
        raise RelayRefused(f"a message of {length} bytes")
    try:
        message = json.loads(_read_exactly(sock, length))
    except ValueError as exc:
        raise RelayRefused(f"not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise RelayRefused("not a JSON object")
    return message


def client_hello(sock: socket.socket, secret: bytes, request: dict[str, Any]) -> None:
    """Prove the secret to the server at the other end of ``sock`` (after it proved it), and send ``request``.

    Raises:
        RelayRefused: the server does not hold the secret.
        ConnectionError: the connection broke.

    Examples:
        >>> import socket, threading, time
        >>> from ignite_ext.data.download._relay_wire import client_hello, server_hello
        >>> a, b = socket.socketpair()
        >>> got = []
        >>> server = threading.Thread(target=lambda: got.append(server_hello(b, b"k", time.monotonic() + 5)))
        >>> server.start(); client_hello(a, b"k", {"offset": 5}); server.join()
        >>> got
        [{'offset': 5}]
    """
    mine = os.urandom(NONCE)
    sock.sendall(mine)
    theirs = _read_exactly(sock, NONCE)
    if not hmac.compare_digest(_read_exactly(sock, _MAC), _mac(secret, b"S", mine, theirs)):
        raise RelayRefused("the relay did not prove that it holds the job's secret")
    body = json.dumps(request, separators=(",", ":")).encode()
    sock.sendall(_mac(secret, b"C", theirs, body) + _LEN.pack(len(body)) + body)


def server_hello(sock: socket.socket, secret: bytes, deadline: float) -> dict[str, Any]:
    """Prove the secret to the client at the other end of ``sock``, check its proof, and return its request.

    The whole exchange must be over by ``deadline`` (``time.monotonic()``): a client that trickles its bytes is
    dropped then.

    Raises:
        RelayRefused: the client does not hold the secret, or sent something else than a request.
        ConnectionError: the connection broke.
        TimeoutError: the deadline passed.
    """
    theirs = _read_exactly(sock, NONCE, deadline)
    mine = os.urandom(NONCE)
    sock.sendall(mine + _mac(secret, b"S", theirs, mine))
    proof = _read_exactly(sock, _MAC, deadline)
    (length,) = _LEN.unpack(_read_exactly(sock, _LEN.size, deadline))
    if length > _MAX_MESSAGE:
        raise RelayRefused(f"a request of {length} bytes")
    body = _read_exactly(sock, length, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"C", mine, body)):
        raise RelayRefused("the client did not prove that it holds the job's secret")
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise RelayRefused(f"not JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise RelayRefused("not a JSON object")
    return request
