"""The holders' side of a job-wide fetch: joining a file's chain, filling the copy from the relays, handing over.

:func:`~ignite_ext.data.download.fetch.download_url`, about to fetch inside a scheduled block of a job
(:func:`in_this_block`), joins the file's chain (:meth:`Relaying.join`), takes the bytes from the holders before
it (:func:`from_relays`) before it turns to the origin, and hands its copy over when it is published
(:func:`hand_over`) or its error when it gives up on the origin (:func:`gave_up`). Its relay serves until the
rank leaves the block.

Importing it imports neither torch nor :mod:`ignite_ext.distributed` (plain downloads do not need them): the
functions that run only inside a job import them.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ignite_ext.data.download._chain import Chain, Holder, file_id
from ignite_ext.data.download._job import Job
from ignite_ext.data.download._partial import Partial
from ignite_ext.data.download._relay_client import RelayGone, RelayUnreachable, receive
from ignite_ext.data.download._relay_server import Growing, RelayServer, Version
from ignite_ext.data.download._verify import mismatch
from ignite_ext.errors import DownloadError
from ignite_ext.settings import RELAY, RELAY_ADDR, RELAY_PORTS

__all__ = [
    "RELAYED",
    "RELAY_ADDR_ENV",
    "RELAY_ENV",
    "RELAY_PORTS_ENV",
    "Member",
    "Relaying",
    "from_relays",
    "gave_up",
    "hand_over",
    "in_this_block",
    "relay_host",
    "relay_ports",
]

logger = logging.getLogger("ignite_ext.data.download")

#: The address a holder's relay listens on, where the one that reaches the job's store is not the right one.
RELAY_ADDR_ENV = RELAY_ADDR.name


#: The ports a holder's relay may listen on (``first-last``), where a firewall lets only those through; unset: any.
RELAY_PORTS_ENV = RELAY_PORTS.name


def relay_ports() -> range:
    """The ports a relay may listen on: ``IGNITE_EXT_RELAY_PORTS`` (``45000-45099``, or one port), else any (0).

    The docs' settings page (:doc:`/settings`) lists it with the package's other variables.

    Examples:
        >>> import os
        >>> from ignite_ext.data.download._relaying import relay_ports
        >>> relay_ports()
        range(0, 1)
        >>> os.environ["IGNITE_EXT_RELAY_PORTS"] = "45000-45099"
        >>> relay_ports()
        range(45000, 45100)
        >>> os.environ["IGNITE_EXT_RELAY_PORTS"] = "45000-44000"
        >>> relay_ports()
        Traceback (most recent call last):
        ...
        ValueError: IGNITE_EXT_RELAY_PORTS='45000-44000': expected a port or a range 'first-last' of 1-65535
        >>> del os.environ["IGNITE_EXT_RELAY_PORTS"]

    .. versionadded:: 0.4.0
    """
    return RELAY_PORTS.read()


def relay_host() -> str:
    """The address of this host's interface toward the job's store: the one the process group uses.

    ``IGNITE_EXT_RELAY_ADDR`` if set; else the local end of a route to ``MASTER_ADDR`` (a UDP socket's
    ``connect`` sends nothing); else the host name's address.

    Examples:
        >>> import os
        >>> from ignite_ext.data.download._relaying import relay_host
        >>> os.environ["MASTER_ADDR"] = "127.0.0.1"
        >>> relay_host()
        '127.0.0.1'

    .. versionadded:: 0.3.0
    """
    if override := RELAY_ADDR.read():
        return override
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master), 9))
            return str(probe.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())


@dataclass
class Member:
    """This process's place in a file's chain, and its relay."""

    chain: Chain
    place: int
    secret: bytes = field(repr=False)
    growing: Growing = field(repr=False)
    server: RelayServer = field(repr=False)
    origin: str = ""
    rank: int = 0
    #: Whether this holder's bytes come from the origin (the first holder, or one whose holders before it were lost).
    from_origin: bool = False

    def close(self) -> None:
        self.server.stop()
        self.growing.close()


@dataclass
class Relaying:
    """The chains one ``download_url`` call in a scheduled block joined on this rank, and their relays.

    .. versionadded:: 0.3.0
    """

    store: Any
    rank: int
    block: int = 0
    members: list[Member] = field(default_factory=list)

    def join(self, target: Path, urls: Sequence[str], job: Job, partial: Partial) -> Member | None:
        """Join the chain of ``target``'s file and start serving ``partial`` to the holders after this one.

        None when that cannot be done (no address to listen on, the store refusing): then this holder fetches
        from the origin by itself, as outside a job, and says why in the log.
        """
        chain = Chain(self.store, file_id(urls[0], target.name, job.expected), self.block)
        growing = Growing()
        server: RelayServer | None = None
        try:
            secret = chain.secret()
            io_timeout = job.timeout + job.low_speed_time
            server = RelayServer(growing, secret, chain.file, relay_host(), io_timeout, ports=relay_ports())
            place = chain.join()
            chain.post(Holder(place, self.rank, *server.address))
        except (OSError, RuntimeError, ValueError) as exc:  # socket errors, the store's (RuntimeError), bad JSON
            logger.warning(
                "relay: cannot share %s between the job's ranks (%s); this rank downloads it alone", target.name, exc
            )
            if server is not None:
                server.stop()
            growing.close()
            return None
        partial.observer = growing
        if partial.total is not None and partial.validator is not None and partial.url == urls[0]:
            growing.source(
                partial.total, partial.validator.etag, partial.validator.last_modified, partial.fd, partial.size
            )
        member = Member(chain, place, secret, growing, server, urls[0], self.rank, from_origin=place == 1)
        self.members.append(member)
        logger.info(
            "relay: this rank holds copy %d of %s and serves it to the next on %s:%d",
            place,
            target.name,
            *server.address,
        )
        return member

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.members.clear()


#: ``0`` turns relaying off: each holder then fetches from the origin, as outside a job.
RELAY_ENV = RELAY.name


def in_this_block() -> Relaying | None:
    """A new :class:`Relaying` for a fetch inside a scheduled block of a job with a store, else None.

    Its relays stop when this rank leaves the block (:func:`~ignite_ext.distributed.at_block_end`): every rank
    has its directory's copy by then. Outside a job (no ``ignite_ext.distributed`` imported: nothing can be
    scheduled) it costs nothing and imports nothing.
    """
    if not RELAY.read() or "ignite_ext.distributed" not in sys.modules:
        return None
    import ignite_ext.distributed as idist

    store = idist.job_store()
    if store is None:
        return None
    block = idist.current_block()
    if block is None:
        return None
    relaying = Relaying(store, idist.get_rank(), block)
    return relaying if idist.at_block_end(relaying.close) else None


#: Bytes relayed without a digest to check them by are recorded under this prefix of the origin's URL: neither a
#: switch to the origin nor a later call resumes from them (only the digest its holder posts can vouch for them).
RELAYED = "relayed+"
#: How often a relay that closed early is asked again while its holder is alive (its bytes may have started over).
_RECONNECTS = 2


def from_relays(member: Member, partial: Partial, job: Job) -> bool:
    """Fill ``partial`` from the holders before this one, nearest first; True when it holds a verified copy.

    False: no holder before it could finish a copy that passes the check (each lost, gone, or without a digest
    to check against): the caller goes to the origin, resuming only from bytes of the origin's version that
    a digest given will check.

    Raises:
        DownloadError: the origin failed the holder fetching from it (the same error), or this call's deadline
            passed.
        OSError: writing the copy failed (the disk is full).
    """
    from ignite_ext.distributed import lost_ranks as lost
    from ignite_ext.distributed.liveness import beat_interval, heartbeat_timeout

    source = member.origin if job.expected else RELAYED + member.origin
    before: list[int] = []  # the ranks of the holders before this one, as found
    unreachable = False
    for place in range(member.place - 1, 0, -1):
        _check_not_lost(member.rank)
        holder = member.chain.holder(place, timeout=heartbeat_timeout())
        if holder is None:
            continue
        before.append(holder.rank)
        for attempt in range(_RECONNECTS + 1):
            if holder.rank in lost():
                break
            try:
                receive(
                    (holder.host, holder.port),
                    member.secret,
                    member.chain.file,
                    partial,
                    source,
                    alive=_alive(holder.rank),
                    slice_s=beat_interval(),
                    check=lambda: job.check_deadline(member.origin),
                )
            except RelayGone as exc:
                if (failure := member.chain.failure()) is not None:
                    raise failure from None
                if isinstance(exc, RelayUnreachable):
                    # The network drops the relays' ports: every holder's alike, so the origin it is, at once.
                    logger.warning("relay: %s; fetching from the origin", exc)
                    unreachable = True
                    break
                logger.warning("relay: %s (try %d of %d)", exc, attempt + 1, _RECONNECTS + 1)
                continue
            if _verified(member, partial, job, before):
                return True
            logger.warning("relay: the copy received from rank %d failed its checksum; starting over", holder.rank)
            partial.restart()  # bytes that fail the check are of no use from any source
            break
        if unreachable:
            break
    if (failure := member.chain.failure()) is not None:
        raise failure
    _check_not_lost(member.rank)
    if partial.url == source and not job.expected:
        partial.restart()  # relayed bytes that no digest vouches for: the origin's copy starts from byte 0
    return False


def _check_not_lost(rank: int) -> None:
    """Raise ``RankDiedError`` if the job declared this rank dead (it was stopped or cut off for ``T``).

    The others have given up on it and gone on without it: it must neither carry on nor ask the origin.
    """
    from ignite_ext.distributed import lost_ranks
    from ignite_ext.errors import RankDiedError, RankFailure

    if rank in lost_ranks():
        died = RankFailure(rank, RankDiedError.__name__, "declared dead by its peers while it fetched", died=True)
        raise RankDiedError([died], f"rank {rank} fetching for the job")


def _alive(rank: int) -> Callable[[], bool]:
    from ignite_ext.distributed import lost_ranks

    return lambda: rank not in lost_ranks()


def _verified(member: Member, partial: Partial, job: Job, before: list[int]) -> bool:
    """Whether the copy is the file: against the digest given, else the one a holder that fetched it posts.

    Waits for that digest while a holder before this one is alive and none of those fetching from the origin
    gave up or stopped; ``job``'s deadline bounds the wait.
    """
    from ignite_ext.distributed import lost_ranks
    from ignite_ext.distributed.liveness import beat_interval

    if job.expected:
        return mismatch(job.expected, partial.digests()) is None
    while True:  # the holder fetching from the origin posts its digest once its own copy is published: about now
        posted = member.chain.outcome(timeout=beat_interval())  # one wait on one key per slice: no polling
        if isinstance(posted, tuple):
            return posted == (partial.digests()["sha256"], partial.size)
        if posted is not None:
            return False  # "failed" or "abandoned": no digest is coming; this copy cannot be checked
        job.check_deadline(member.origin)
        if set(before) <= lost_ranks():
            return False  # every holder that could post it is lost (learnt without a request)


def hand_over(member: Member, partial: Partial, target: Path) -> None:
    """``partial`` is published as ``target``: serve all of it, and post its digest if it came from the origin."""
    if member.growing.version is None:  # the origin did not give the size: relays could not start before now
        fd = os.open(target, os.O_RDONLY)
        try:
            validator = partial.validator
            etag, modified = (validator.etag, validator.last_modified) if validator is not None else (None, None)
            member.growing.start(Version(partial.size, etag, modified), fd, partial.size)
        finally:
            os.close(fd)
    member.growing.end()
    if member.from_origin:
        member.chain.post_digest(partial.digests()["sha256"], partial.size)


def gave_up(member: Member, exc: DownloadError | None) -> None:
    """This holder stopped without a copy; ``exc``: the origin failed it, and every holder raises that error.

    With ``exc`` None (a reason of its own: its disk, its deadline, an error of its process), the holders after
    it turn to the holders before it or the origin, and wait for no digest from it.
    """
    member.growing.end()
    if not member.from_origin:
        return
    with contextlib.suppress(OSError, RuntimeError):  # the store gone too: the block reports that
        if exc is not None:
            member.chain.post_failure(exc)
        else:
            member.chain.abandon()
