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
from ignite_ext.data.download._relay_client import RelayGone, receive
from ignite_ext.data.download._relay_server import Growing, RelayServer, Version
from ignite_ext.data.download._verify import mismatch
from ignite_ext.errors import DownloadError

__all__ = [
    "RELAY_ADDR_ENV",
    "RELAY_ENV",
    "Member",
    "Relaying",
    "from_relays",
    "gave_up",
    "hand_over",
    "in_this_block",
    "relay_host",
]

logger = logging.getLogger("ignite_ext.data.download")

#: The address a holder's relay listens on, where the one that reaches the job's store is not the right one.
RELAY_ADDR_ENV = "IGNITE_EXT_RELAY_ADDR"


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
    if override := os.environ.get(RELAY_ADDR_ENV):
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
    secret: bytes
    growing: Growing
    server: RelayServer
    origin: str
    rank: int
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
    members: list[Member] = field(default_factory=list)

    def join(self, target: Path, urls: Sequence[str], job: Job, partial: Partial) -> Member:
        """Join the chain of ``target``'s file and start serving ``partial`` to the holders after this one."""
        chain = Chain(self.store, file_id(urls[0], target.name, job.expected))
        growing = Growing()
        partial.observer = growing
        if partial.total is not None and partial.validator is not None and partial.url == urls[0]:
            growing.source(
                partial.total, partial.validator.etag, partial.validator.last_modified, partial.fd, partial.size
            )
        secret = chain.secret()
        server = RelayServer(growing, secret, chain.file, relay_host(), io_timeout=job.timeout + job.low_speed_time)
        place = chain.join()
        chain.post(Holder(place, self.rank, *server.address))
        member = Member(chain, place, secret, growing, server, urls[0], self.rank, from_origin=place == 1)
        self.members.append(member)
        logger.info("relay: holder %d of %s, serving on %s:%d", place, target.name, *server.address)
        return member

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.members.clear()


#: ``0`` turns relaying off: each holder then fetches from the origin, as outside a job.
RELAY_ENV = "IGNITE_EXT_RELAY"


def in_this_block() -> Relaying | None:
    """A new :class:`Relaying` for a fetch inside a scheduled block of a job with a store, else None.

    Its relays stop when this rank leaves the block (:func:`~ignite_ext.distributed.at_block_end`): every rank
    has its directory's copy by then. Outside a job (no ``ignite_ext.distributed`` imported: nothing can be
    scheduled) it costs nothing and imports nothing.
    """
    if os.environ.get(RELAY_ENV, "1") == "0" or "ignite_ext.distributed" not in sys.modules:
        return None
    import ignite_ext.distributed as idist

    store = idist.job_store()
    if store is None:
        return None
    relaying = Relaying(store, idist.get_rank())
    return relaying if idist.at_block_end(relaying.close) else None


def from_relays(member: Member, partial: Partial, job: Job) -> bool:
    """Fill ``partial`` from the holders before this one, nearest first; True when it holds a verified copy.

    False: no holder before it could finish it (each lost or gone): the caller goes to the origin, resuming
    from the bytes held when they are of the origin's version.

    Raises:
        DownloadError: the origin's holder gave up on the origin (the same error), or this call's deadline passed.
        OSError: writing the copy failed (the disk is full).
    """
    from ignite_ext.distributed import lost_ranks as lost
    from ignite_ext.distributed.liveness import beat_interval, heartbeat_timeout

    for place in range(member.place - 1, 0, -1):
        _check_not_lost(member.rank)
        holder = member.chain.holder(place, timeout=heartbeat_timeout())
        if holder is None or holder.rank in lost():
            continue
        try:
            receive(
                (holder.host, holder.port),
                member.secret,
                member.chain.file,
                partial,
                member.origin,
                alive=_alive(holder.rank),
                slice_s=beat_interval(),
                check=lambda: job.check_deadline(member.origin),
            )
        except RelayGone as exc:
            if (failure := member.chain.failure()) is not None:
                raise failure from None
            logger.warning("relay: %s; turning to the holder before it", exc)
            continue
        if _verified(member, partial, job):
            return True
        logger.warning("relay: the copy from holder %d failed its check; starting over", place)
        partial.restart()  # bytes that fail the check are of no use from any source
    if (failure := member.chain.failure()) is not None:
        raise failure
    _check_not_lost(member.rank)
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


def _verified(member: Member, partial: Partial, job: Job) -> bool:
    """Whether the copy is the file: against the digest given, else the one the origin's holder posts."""
    from ignite_ext.distributed import lost_ranks
    from ignite_ext.distributed.liveness import beat_interval

    if job.expected:
        return mismatch(job.expected, partial.digests()) is None
    while True:  # the origin's holder posts its digest once its own copy is published: about now
        posted = member.chain.digest(timeout=beat_interval())
        if posted is not None:
            return posted == (partial.digests()["sha256"], partial.size)
        if member.chain.failure() is not None:
            return False
        first = member.chain.holder(1, timeout=0.0)
        if first is None or first.rank in lost_ranks():
            return False  # nobody will post it: this copy cannot be checked; the origin's can


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


def gave_up(member: Member, exc: DownloadError) -> None:
    """This holder gave up on the origin: every holder raises ``exc`` rather than try the origin again."""
    member.growing.end()
    if member.from_origin:
        member.chain.post_failure(exc)
