"""A client of torch's TCPStore in the standard library alone, and the proof that it speaks this torch's protocol.

The keeper (:mod:`~ignite_ext.distributed.liveness.keeper`) is a process without torch, and the cut listener must
not hold a torch client's lock: both talk to the group's store with :class:`WireStore`. The protocol is torch's
own, private and versioned (``torch/csrc/distributed/c10d/TCPStoreBackend.hpp``, ``enum class QueryType``):

* ``validated`` (torch 2.2 and later, proven on 2.5.1, 2.13.0 and 2.14.1, checked by hand on 2.2.2): a
  connection starts with ``VALIDATE`` and the magic number, and the opcodes are numbered from ``VALIDATE = 0``
  (``PING`` came later than 2.2: not used).
* ``legacy`` (torch 2.1, proven on 2.1.2): no validation, the opcodes numbered from ``SET = 0``.

Each request is its opcode (one byte) and its arguments: a string is its length (``uint64``, little endian) and
its bytes, a count an ``uint64``, an amount an ``int64``. ``CHECK`` answers one byte (0: every key is set), ``WAIT``
one byte once every key is set. Keys carry TCPStore's own leading ``/``, then the prefix of the package's keys.

Nothing is taken on trust: :func:`connect_proven` runs every opcode the keeper and the listener use (``SET``,
``GET``, ``ADD``, ``COMPARE_SET``, ``CHECK``, ``WAIT``) against the rank's own torch client, in the one flavour
its torch speaks (:func:`flavour_for`: never a request of the other flavour, which is garbage to a server), and
a rank whose proof fails runs no keeper and no listener (detection by silence alone, within ``4/3 T``), and says
why.

This module imports the standard library only: the keeper loads it by its path.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["FLAVOURS", "MAGIC", "Opcodes", "WireStore", "connect_proven", "flavour_for", "prove", "read"]

#: The number a ``validated`` connection starts with (``validationMagicNumber`` in torch's TCPStore.cpp).
MAGIC = 0x3C85F7CE


class Opcodes:
    """The numbers of the requests used here, in one flavour of torch's ``QueryType``.

    Examples:
        >>> from ignite_ext.distributed.store.wire import FLAVOURS
        >>> FLAVOURS["validated"].ADD, FLAVOURS["legacy"].ADD
        (4, 3)

    .. versionadded:: 0.4.0
    """

    def __init__(self, first: Sequence[str]) -> None:
        names = [*first, "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT"]
        for number, name in enumerate(names):
            setattr(self, name, number)
        self.validated = "VALIDATE" in first

    VALIDATE: int
    SET: int
    COMPARE_SET: int
    GET: int
    ADD: int
    CHECK: int
    WAIT: int


#: The protocol flavours, newest first.
FLAVOURS = {"validated": Opcodes(["VALIDATE"]), "legacy": Opcodes([])}

_ABSENT = b"\x00"  # compare_set on a missing key with this expected value reads without writing


class WireStore:
    """A client of torch's TCPStore that needs no torch: the few requests a keeper and a listener make.

    Args:
        host: the store's host.
        port: the store's port.
        prefix: what goes before each key (after TCPStore's own ``/``): the package's namespace, ``""`` for none.
        timeout: seconds a request may take (None: a request may block for ever, as a ``wait`` does).
        flavour: a key of :data:`FLAVOURS`, as :func:`prove` found it.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> import torch
        >>> from ignite_ext.distributed.store.wire import WireStore, flavour_for
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> flavour = flavour_for(torch.__version__)
        >>> wire = WireStore("127.0.0.1", server.port, "", timeout=5.0, flavour=flavour)
        >>> wire.add("n", 2), server.add("n", 1), wire.read("n"), wire.read("missing")
        (2, 3, b'3', None)
        >>> wire.close()

    .. versionadded:: 0.3.0
    """

    def __init__(self, host: str, port: int, prefix: str, timeout: float | None, flavour: str = "validated") -> None:
        self.flavour = flavour  # a key of FLAVOURS
        self._op = FLAVOURS[flavour]
        self._prefix = "/" + prefix  # TCPStore itself puts "/" before every key
        self._sock = socket.create_connection((host, port), timeout=timeout if timeout is not None else 30.0)
        self._sock.settimeout(timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._op.validated:  # no PING: torch 2.2 validates but has none (the proof checks every answer anyway)
            self._sock.sendall(struct.pack("<BI", self._op.VALIDATE, MAGIC))

    def settimeout(self, timeout: float | None) -> None:
        """Seconds a request may take from now on (None: for ever)."""
        self._sock.settimeout(timeout)

    def _exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self._sock.recv(left)
            if not chunk:
                raise ConnectionError("the store closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _bytes(self, value: bytes) -> bytes:
        return struct.pack("<Q", len(value)) + value

    def _key(self, key: str) -> bytes:
        return self._bytes((self._prefix + key).encode())

    def _vector(self) -> bytes:
        return self._exactly(struct.unpack("<Q", self._exactly(8))[0])

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to counter ``key`` (made at 0) and return its new value."""
        self._sock.sendall(struct.pack("<B", self._op.ADD) + self._key(key) + struct.pack("<q", amount))
        return int(struct.unpack("<q", self._exactly(8))[0])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Torch's ``compare_set``: ``desired`` if ``key`` held ``expected`` (or was missing and ``expected`` empty)."""
        payload = self._key(key) + self._bytes(expected) + self._bytes(desired)
        self._sock.sendall(struct.pack("<B", self._op.COMPARE_SET) + payload)
        return self._vector()

    def get(self, key: str) -> bytes:
        """``key``'s value; blocks until it is set (up to the timeout)."""
        self._sock.sendall(struct.pack("<B", self._op.GET) + self._key(key))
        return self._vector()

    def read(self, key: str) -> bytes | None:
        """``key``'s value, or None when it is missing: one request that never blocks."""
        value = self.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT else value

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` (no answer comes back)."""
        self._sock.sendall(struct.pack("<B", self._op.SET) + self._key(key) + self._bytes(value))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key of ``keys`` is set: one request that never blocks."""
        parts = [struct.pack("<BQ", self._op.CHECK, len(keys)), *(self._key(k) for k in keys)]
        self._sock.sendall(b"".join(parts))
        return self._exactly(1) == b"\x00"

    def wait(self, keys: Sequence[str]) -> None:
        """Block until every key of ``keys`` exists (for ever with ``timeout=None``; :meth:`close` ends it)."""
        parts = [struct.pack("<BQ", self._op.WAIT, len(keys)), *(self._key(k) for k in keys)]
        self._sock.sendall(b"".join(parts))
        self._exactly(1)

    def detach(self) -> None:
        """Close this process's descriptor only: the connection goes on for the other holders (a forked parent)."""
        self._sock.close()

    def close(self) -> None:
        """Close the connection; a :meth:`wait` blocked in another thread returns with an error."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class _Torch:
    """What :func:`prove` needs of the rank's own torch client (typed here without torch)."""

    set: Callable[[str, str], None]
    compare_set: Callable[[str, str, str], bytes]
    add: Callable[[str, int], int]
    delete_key: Callable[[str], bool]


class _ComparesAndSets(Protocol):
    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes: ...


def read(client: _ComparesAndSets, key: str) -> bytes | None:
    """The value of ``key`` in a torch store, or None when it is not set (one request, and it never blocks).

    A ``compare_set`` whose expected value no key holds: it writes nothing and answers the value (torch 2.1's stores
    have no ``check``).

    Examples:
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.wire import read
        >>> store = dist.HashStore(); store.set("a", "1")
        >>> read(store, "a"), read(store, "b")
        (b'1', None)

    .. versionadded:: 0.2.0
    .. versionchanged:: 0.5.0
        Here, the one copy (it was ``clients.read``, where it is still importable from).
    """
    value = bytes(client.compare_set(key, _ABSENT.decode(), "-"))
    return None if value == _ABSENT else value


def _prove_one(wire: WireStore, client: _Torch, probe: str) -> str | None:
    """Why ``wire`` does not speak as ``client`` does on keys under ``probe`` (None: every opcode agreed).

    Only requests that never block: a wire client under another prefix than torch's must fail at once.
    """
    # A set has no answer: a request with one on the same connection is what orders it before the other's read.
    wire.set(f"{probe}/s", b"set")
    wire.read(f"{probe}/s")
    if read(client, f"{probe}/s") != b"set":
        return "SET"
    client.set(f"{probe}/g", "get")
    read(client, f"{probe}/g")
    if not wire.check([f"{probe}/s", f"{probe}/g"]) or wire.check([f"{probe}/s", f"{probe}/missing"]):
        return "CHECK"
    if wire.get(f"{probe}/g") != b"get":
        return "GET"
    if wire.add(f"{probe}/a", 2) != 2 or int(client.add(f"{probe}/a", 1)) != 3 or wire.add(f"{probe}/a", 0) != 3:
        return "ADD"
    if wire.compare_set(f"{probe}/c", b"", b"cs") != b"cs" or read(client, f"{probe}/c") != b"cs":
        return "COMPARE_SET"
    wire.wait([f"{probe}/s", f"{probe}/g"])
    return None


def prove(host: str, port: int, prefix: str, client: object, probe: str, flavour: str) -> tuple[str | None, str]:
    """Whether ``client`` speaks ``flavour`` (see :func:`connect_proven`), the connection closed after.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> import torch
        >>> from ignite_ext.distributed.store.wire import flavour_for, prove
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> ours = flavour_for(torch.__version__)
        >>> prove("127.0.0.1", server.port, "", server, "proof", ours)[0] == ours
        True
        >>> flavour, why = prove("127.0.0.1", server.port, "elsewhere/", server, "proof", ours)  # not torch's keys
        >>> flavour, "SET disagreed" in why
        (None, True)

    .. versionadded:: 0.4.0
    """
    wire, why = connect_proven(host, port, prefix, client, probe, flavour)
    if wire is None:
        return None, why
    wire.close()
    return wire.flavour, ""


def flavour_for(torch_version: str) -> str:
    """The protocol flavour of the TCPStore that ``torch_version`` serves and speaks (the job's own torch).

    Only that flavour is tried: a request of the other flavour is garbage to a server (a ``legacy`` server
    reads the validation number as the length of a key; a ``validated`` one logs the stranger by its name,
    which can cost its one thread a DNS timeout).

    Examples:
        >>> from ignite_ext.distributed.store.wire import flavour_for
        >>> flavour_for("2.1.2+cu121"), flavour_for("2.5.1"), flavour_for("2.13.0+cpu")
        ('legacy', 'validated', 'validated')

    .. versionadded:: 0.4.0
    """
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2] if part.isdigit())
    return "legacy" if release < _FIRST_VALIDATED else "validated"


#: The first torch release whose TCPStore starts each connection with VALIDATE (see scripts/compat.sh's runs).
_FIRST_VALIDATED = (2, 2)

#: Connections a proof may open: a server that closes one under load gets another chance, not a verdict.
_TRIES = 3


def connect_proven(
    host: str, port: int, prefix: str, client: object, probe: str, flavour: str
) -> tuple[WireStore | None, str]:
    """A wire client that speaks as ``client`` (the rank's torch client, under ``prefix``) does, proven.

    Every opcode used here runs on keys under ``probe`` (deleted after), each checked against ``client``: about
    12 requests, once per process, in ``flavour`` only (:func:`flavour_for`). Returns the open connection that
    passed (the caller keeps or closes it: the cut listener keeps it, so the proof costs the store no connection
    of its own), or ``(None, why)``.

    .. versionadded:: 0.4.0
    """
    torch_client: _Torch = client  # type: ignore[assignment]
    why = ""
    for _ in range(_TRIES):
        try:
            wire = WireStore(host, port, prefix, timeout=5.0, flavour=flavour)
        except (OSError, struct.error) as exc:
            why = f"{flavour}: {type(exc).__name__}: {exc}"
            continue
        try:
            failed = _prove_one(wire, torch_client, probe)
        except (OSError, struct.error, RuntimeError) as exc:  # RuntimeError: torch's client timed out on a key
            failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            for suffix in ("s", "g", "a", "c"):
                with contextlib.suppress(RuntimeError):
                    torch_client.delete_key(f"{probe}/{suffix}")
        if failed is None:
            return wire, ""
        wire.close()
        why = f"{flavour}: {failed} disagreed" if " " not in failed else f"{flavour}: {failed}"
        if " " not in failed:
            break  # an answer that disagrees is a verdict; a lost connection may be the load's
    return None, why
