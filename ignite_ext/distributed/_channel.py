"""How ranks learn that the ranks they wait for finished, failed or died: the protocol, and which channel runs it.

Two channels implement one protocol (:class:`Channel`):

* :class:`~ignite_ext.distributed._store_channel.StoreChannel`, on every backend that can reach a store: waits go
  through the process group's key-value store (:mod:`ignite_ext.distributed.store.clients`; on Horovod and XLA, which
  have none, a TCPStore that rank 0 hosts: :mod:`ignite_ext.distributed.store.side`), never a collective, so a
  first rank may work far longer than the process group's timeout. Every rank inside a scheduler beats a
  heartbeat key from a daemon thread; a rank whose heartbeat stops (SIGKILL, OOM kill, machine loss) is declared
  dead by whoever waits for it, exactly once, and everyone waiting learns it as a failure instead of hanging.
* :class:`~ignite_ext.distributed._collective.CollectiveChannel`, the fallback (Horovod or XLA ranks that cannot
  all reach rank 0's TCPStore, or when forced with ``IGNITE_EXT_SCHEDULER_CHANNEL=collective``): all ranks step
  through the plan's waves in lockstep, one small ``all_gather`` per wave. Waits are bounded by the backend's
  own collective timeout, and a dead rank is detected only as far as the backend detects it.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from ignite_ext.distributed.policies import Plan
from ignite_ext.errors import RankFailedError, RankFailure

__all__ = [
    "Channel",
    "decode_failures",
    "encode_failures",
    "log",
]

_LOGGER_NAME = "ignite_ext.distributed"
_IGNITE_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"  # ignite.utils.setup_logger's default
_SETUP_LOCK = threading.Lock()


def log() -> logging.Logger:
    """The scheduler's logger, set up the ignite way on first use unless the application configured logging.

    Configured means a handler or a level on this logger, or a handler on the root logger (``basicConfig``): then
    its choices stand. Otherwise the logger gets what ``ignite.utils.setup_logger`` gives a new logger (INFO, a
    stderr handler in ignite's format, no propagation), on every rank: the lines that matter come from waiting
    ranks, which ignite's default (output on rank 0 only) would silence. It is added here rather than through
    ``setup_logger``, which leaves a logger that already exists as it is, and this one exists from import on.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if logger.handlers or logger.level != logging.NOTSET or logging.getLogger().handlers:
        return logger
    with _SETUP_LOCK:
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_IGNITE_FORMAT))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    return logger


def encode_failures(failures: Iterable[RankFailure]) -> bytes:
    """The failures a rank reports, as the bytes other ranks read (ASCII JSON)."""
    return json.dumps([[f.rank, f.exc_type, f.message, f.died, f.where] for f in failures]).encode()


def decode_failures(payload: bytes) -> list[RankFailure]:
    """The failures in ``payload`` (see :func:`encode_failures`); a line after it (who wrote it) is ignored."""
    text = payload.split(b"\n", 1)[0].decode()
    return [RankFailure(int(r), str(t), str(m), bool(d), str(w)) for r, t, m, d, w in json.loads(text)]


class Channel(ABC):
    """The waiting protocol of one scheduled block on one rank: entry exchange, then the plan's waits."""

    def __init__(self, rank: int, world_size: int, label: str, timeout: float | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.label = label
        self.timeout = timeout
        self.plan = Plan(())

    @abstractmethod
    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """Give every rank's entry (``mine``) to ``judge`` and return its verdict, the same on every rank."""

    def start(self, plan: Plan) -> None:
        """Adopt the plan agreed on; ``wait_turn`` and ``leave`` follow it."""
        self.plan = plan

    @abstractmethod
    def wait_turn(self) -> list[RankFailure]:
        """Block until this rank may run; return the failures it inherits (then it must not run)."""

    def explain(self, exc: BaseException) -> RankFailedError | None:
        """The ranks' failure that explains ``exc``, a collective of the plan that failed, or None if none does."""
        return None

    @abstractmethod
    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        """Report this rank's outcome; unless it failed, wait for everyone and return every original failure.

        ``linger=False`` (a rank that timed out) leaves as soon as its outcome is posted.
        """
