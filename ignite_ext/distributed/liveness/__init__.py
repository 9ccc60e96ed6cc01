"""Failure detection: which ranks of a process group are dead, decided once and the same for every rank.

* :mod:`~ignite_ext.distributed.liveness.detector`: the decisions, a pure state machine (no thread, store or
  clock of its own).
* :mod:`~ignite_ext.distributed.liveness.heartbeat`: its driver, one daemon thread per process and store, which
  beats, reads and posts the cuts; the layers above run their errands in it (the scheduler's wakes its waiting
  threads).
* :mod:`~ignite_ext.distributed.liveness.keeper`: the keeper, a process beside each rank that beats for it while
  its process runs (a GIL hold is not a death) and reports its process's end at once.
* :mod:`~ignite_ext.distributed.liveness.watch`: the rank's side of it, and the thread that hears of each cut as
  it is posted.
* :mod:`~ignite_ext.distributed.liveness.settings`: the settings, read from the environment.

Liveness stands on the store room (:mod:`ignite_ext.distributed.store`) alone and imports nothing of the
scheduler. Nothing starts at import: :func:`watch_for_groups` starts the thread that waits for a process group.

.. versionadded:: 0.3.0
"""

from ignite_ext.distributed.liveness.detector import Cut, Detector
from ignite_ext.distributed.liveness.heartbeat import Errand, Heartbeat, watch_for_groups
from ignite_ext.distributed.liveness.settings import (
    beat_interval,
    early_heartbeat,
    env_float,
    heartbeat_timeout,
    log_interval,
    process_watch,
    stall_timeout,
)

__all__ = [
    "Cut",
    "Detector",
    "Errand",
    "Heartbeat",
    "beat_interval",
    "early_heartbeat",
    "env_float",
    "heartbeat_timeout",
    "log_interval",
    "process_watch",
    "stall_timeout",
    "watch_for_groups",
]
