"""A holder's side of a relay: receive the file from another holder of the job into its own temp file.

The bytes go into the holder's :class:`~ignite_ext.data.download._partial.Partial`, recorded as the origin's (its
first URL and the version the relay names), so a crash, a relay's death or a switch to the origin resumes from
them, and only on the same version: a relay that serves another version starts the file over.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable

from ignite_ext.data.download._http import Validator
from ignite_ext.data.download._partial import Partial
from ignite_ext.data.download._relay_wire import HANDSHAKE_TIMEOUT_S, client_hello, read_message
from ignite_ext.data.download._verify import CHUNK
from ignite_ext.errors import IgniteExtError

__all__ = ["CONNECT_TIMEOUT_S", "RelayGone", "RelayUnreachable", "receive"]

#: Seconds a relay has to accept a connection. The job's hosts share a network, where a connection is accepted in
#: milliseconds and a lost SYN is sent again after 1 s; a port that a firewall filters (packets dropped, not
#: refused) would otherwise hold each holder for the system's TCP timeout (minutes) before the origin.
CONNECT_TIMEOUT_S = 3.0


class RelayGone(IgniteExtError, ConnectionError):
    """The relay could not serve the rest of the file: unreachable, closed, refused, or its rank was lost.

    Never leaves the job-wide fetch: the holder then turns to another holder, or to the origin.

    .. versionadded:: 0.3.0
    """


class RelayUnreachable(RelayGone):
    """No relay answered a connection within :data:`CONNECT_TIMEOUT_S`: a firewall drops the relays' ports.

    The network between the job's hosts drops every holder's relay alike, so no other holder's relay is asked
    either: the holder turns to the origin.

    .. versionadded:: 0.4.0
    """


def receive(
    address: tuple[str, int],
    secret: bytes,
    file_id: str,
    partial: Partial,
    source: str,
    *,
    alive: Callable[[], bool],
    slice_s: float,
    check: Callable[[], None] = lambda: None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> None:
    """Make ``partial`` hold the whole file, from the relay at ``address``; resume from what it holds if it can.

    The bytes are recorded as coming from ``source`` (the origin's URL, or a name of their own when no digest
    will check them), with the version the relay names: only bytes of that source and version are resumed.

    ``alive`` is asked each ``slice_s`` seconds without a byte: a relay whose upstream is slow is waited for as
    long as its rank is alive; one whose rank the job lost is given up. ``check`` is called after each chunk and
    slice (the caller's deadline: what it raises ends the transfer).

    Raises:
        RelayGone: the rest of the file cannot come from this relay.
    """
    try:
        sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
    except TimeoutError as exc:  # dropped, not refused: a filtered port
        raise RelayUnreachable(
            f"relay {address[0]}:{address[1]}: no answer to a connection in {CONNECT_TIMEOUT_S:g} s "
            "(a firewall dropping the relays' ports?)"
        ) from exc
    except OSError as exc:
        raise RelayGone(f"relay {address[0]}:{address[1]}: {exc}") from exc
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    with sock:
        same = partial.url == source and partial.validator is not None and not partial.no_resume
        validator = partial.validator if same and partial.validator is not None else Validator()
        request = {
            "file": file_id,
            "offset": partial.size if same else 0,
            "etag": validator.etag,
            "last_modified": validator.last_modified,
        }
        try:
            client_hello(sock, secret, request)
            # The relay answers once its holder knows the file's size and version (the origin's headers, or its
            # copy's end when the origin gives no size): as long as that takes, while the holder is alive.
            while not select.select([sock], [], [], slice_s)[0]:
                check()
                if not alive():
                    raise RelayGone(f"relay {address[0]}:{address[1]}: its rank was lost")
            answer = read_message(sock)
        except OSError as exc:  # RelayRefused is one
            raise RelayGone(f"relay {address[0]}:{address[1]}: {exc}") from exc
        total, offset = answer.get("total"), answer.get("offset")
        if "error" in answer or not isinstance(total, int) or not isinstance(offset, int):
            raise RelayGone(f"relay {address[0]}:{address[1]}: {answer.get('error', 'a malformed answer')}")
        if offset != partial.size or not same:
            partial.restart()  # another version, or nothing to continue: from byte 0
        partial.resumed = partial.resumed or offset > 0
        partial.note_source(source, Validator(answer.get("etag"), answer.get("last_modified")), total)
        sock.settimeout(slice_s)
        while partial.size < total:
            try:
                chunk = sock.recv(min(CHUNK, total - partial.size))
            except TimeoutError:
                check()
                if not alive():
                    raise RelayGone(f"relay {address[0]}:{address[1]}: its rank was lost") from None
                continue
            except OSError as exc:
                raise RelayGone(f"relay {address[0]}:{address[1]}: {exc}") from exc
            if not chunk:
                raise RelayGone(f"relay {address[0]}:{address[1]}: closed after {partial.size} of {total} bytes")
            partial.append(chunk)
            on_bytes(len(chunk))
            check()
