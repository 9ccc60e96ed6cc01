"""The liveness settings, each read from the environment when it is used.

The variables, their defaults and units are on the docs' settings page (:doc:`/settings`), drawn from
:mod:`ignite_ext.settings`, through which these functions read them.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import os

from ignite_ext.settings import (
    EARLY_HEARTBEAT,
    HEARTBEAT_TIMEOUT,
    PROCESS_WATCH,
    STALL_TIMEOUT,
    WAIT_LOG_INTERVAL,
)

__all__ = [
    "beat_interval",
    "early_heartbeat",
    "env_float",
    "heartbeat_timeout",
    "log_interval",
    "process_watch",
    "stall_timeout",
]


def env_float(name: str, default: float) -> float:
    """The number in environment variable ``name``, or ``default`` when it is unset or not a number.

    The package's own variables are read through :mod:`ignite_ext.settings`, not with this.

    Examples:
        >>> from ignite_ext.distributed.liveness.settings import env_float
        >>> env_float("MY_JOB_NO_SUCH_VARIABLE", 2.5)
        2.5

    .. versionadded:: 0.3.0
    """
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def heartbeat_timeout() -> float:
    """Seconds without a heartbeat after which a rank counts as dead (``IGNITE_EXT_HEARTBEAT_TIMEOUT``).

    A rank's keeper beats for it while its process runs (:mod:`~ignite_ext.distributed.liveness.keeper`), so a
    long GIL hold is not a death and ``T`` can be short: a lost host is reported within ``4/3 T`` = 13.3 s by
    default (torch elastic's rendezvous declares a node dead after 15 s, torchft a replica after 5 s).

    Examples:
        >>> from ignite_ext.distributed.liveness.settings import heartbeat_timeout
        >>> heartbeat_timeout() > 0
        True

    .. versionadded:: 0.3.0
    """
    return HEARTBEAT_TIMEOUT.read()


def beat_interval() -> float:
    """Seconds between two beats of a rank: a sixth of the heartbeat timeout (at least 50 ms).

    Examples:
        >>> import os
        >>> from ignite_ext.distributed.liveness.settings import beat_interval
        >>> os.environ["IGNITE_EXT_HEARTBEAT_TIMEOUT"] = "3"
        >>> beat_interval()
        0.5
        >>> del os.environ["IGNITE_EXT_HEARTBEAT_TIMEOUT"]

    .. versionadded:: 0.3.0
    """
    return max(0.05, heartbeat_timeout() / 6)


def log_interval() -> float:
    """Seconds between two "still waiting" log lines, and a wait's slice (``IGNITE_EXT_WAIT_LOG_INTERVAL``).

    Examples:
        >>> from ignite_ext.distributed.liveness.settings import log_interval
        >>> log_interval() > 0
        True

    .. versionadded:: 0.3.0
    """
    return WAIT_LOG_INTERVAL.read()


def stall_timeout() -> float:
    """The default stall deadline of a scheduled block, in seconds (``IGNITE_EXT_STALL_TIMEOUT``).

    It counts only while a first rank's reported activity is unfinished (see the scheduling guide, "Slow, stalled
    or dead"): an honest download or tokenization advances far more often than every 10 minutes, and a wedged one
    is then reported within 10 minutes instead of never; work that reports nothing is never counted by default.

    Examples:
        >>> from ignite_ext.distributed.liveness.settings import stall_timeout
        >>> stall_timeout()
        600.0

    .. versionadded:: 0.4.0
    """
    return STALL_TIMEOUT.read()


def early_heartbeat() -> bool:
    """Whether ranks beat from the moment their process group exists (``IGNITE_EXT_EARLY_HEARTBEAT``).

    Off (``0``), a rank beats from its first scheduled block, and a rank that never beat is never declared dead
    (it cannot be told from one that has not reached a block yet).

    Examples:
        >>> from ignite_ext.distributed.liveness.settings import early_heartbeat
        >>> early_heartbeat()
        True

    .. versionadded:: 0.3.0
    """
    return EARLY_HEARTBEAT.read()


def process_watch() -> bool:
    """Whether each rank runs a keeper process and hears of cuts at once (``IGNITE_EXT_PROCESS_WATCH``).

    See :mod:`~ignite_ext.distributed.liveness.keeper`. Off (``0``), a death is found by its silence only (within
    ``4/3 T``) and a rank whose heartbeat thread cannot run for ``T`` (a long GIL hold) is declared dead.

    Examples:
        >>> import os
        >>> from ignite_ext.distributed.liveness.settings import process_watch
        >>> os.environ["IGNITE_EXT_PROCESS_WATCH"] = "0"
        >>> process_watch()
        False
        >>> del os.environ["IGNITE_EXT_PROCESS_WATCH"]
        >>> process_watch()
        True

    .. versionadded:: 0.3.0
    """
    return PROCESS_WATCH.read()
