"""Restarts within a job: the stamps by which a restarted worker group adopts the caches of the attempt before.

An arena is stamped at creation with its *job* (:func:`job_key`: the run id and the agent that started this
elastic worker, so a later job, even with torchrun's default run id, adopts nothing), its *cache*
(:func:`cache_key`: what tells the job's caches apart, so each has one successor) and its *agent*
(:func:`agent_stamp`): every sweep leaves an arena to its successor while that agent lives (:func:`agent_lives`).
Adoption itself (renamed, checked, counters restarted) is the file's life's (:mod:`~ignite_ext.data.cache._life`);
the cache guide's *Restarts within a job* says what a user sees.

In a Slurm job the job is the agent (:mod:`ignite_ext._slurm`) and its id the job key: a requeued run adopts too.

.. versionadded:: 0.3.0
.. versionchanged:: 0.4.0
   The agent's stamp: a sweep by another job spares the arenas of a job whose agent lives.
.. versionchanged:: 0.6.0
   A Slurm job is an agent: its requeued run adopts its node caches.
"""

from __future__ import annotations

import hashlib
import os
import sys

from ignite_ext import _slurm
from ignite_ext._fs import process_identity

__all__ = ["NO_JOB", "agent_lives", "agent_stamp", "cache_key", "job_key", "leaving_for_a_restart"]

#: Stamped where no job is known (not an elastic worker): never adopted, swept as soon as its creator is gone.
NO_JOB = 0


def _digest(text: str) -> int:
    """A non-zero 63-bit digest of ``text`` (a header word that :data:`NO_JOB` cannot be)."""
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    return value or 1


def job_key() -> int:
    """This process's job on this host, as arenas are stamped with it: :data:`NO_JOB` outside an elastic worker.

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.restart import NO_JOB, job_key
        >>> os.environ.pop("TORCHELASTIC_RUN_ID", None) and None
        >>> job_key() == NO_JOB
        True
        >>> os.environ["TORCHELASTIC_RUN_ID"] = "run-1"
        >>> job_key() != NO_JOB, job_key() == job_key()
        (True, True)
        >>> del os.environ["TORCHELASTIC_RUN_ID"]

    .. versionadded:: 0.3.0
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    slurm = _slurm.job_text()
    if slurm is not None:  # the same in every run of the job, requeued or not, and in each of torchrun's attempts
        return _digest(f"job|{slurm}|{run_id or ''}")
    identity = _agent_identity()
    if not run_id or identity is None:  # nothing tells this job's agent from a later one's: adopt nothing
        return NO_JOB
    return _digest(f"job|{identity}|{run_id}")


def _agent_identity() -> str | None:
    """The :func:`~ignite_ext._fs.process_identity` of this elastic worker's agent (its parent), else None."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    return process_identity(os.getppid())


def agent_stamp() -> tuple[int, int]:
    """The agent that this process's arenas are stamped with: its pid and a digest of its identity.

    In a Slurm job, the job's stamp (:func:`~ignite_ext._slurm.stamp`) and a digest of the job.
    Zeros outside an elastic worker or a Slurm job, or where the agent cannot be identified.

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.restart import agent_lives, agent_stamp
        >>> os.environ.pop("TORCHELASTIC_RUN_ID", None) and None
        >>> agent_stamp()
        (0, 0)
        >>> os.environ["TORCHELASTIC_RUN_ID"] = "run-1"
        >>> pid, digest = agent_stamp()
        >>> pid == os.getppid(), agent_lives(pid, digest)
        (True, True)
        >>> del os.environ["TORCHELASTIC_RUN_ID"]

    .. versionadded:: 0.4.0
    """
    slurm = _slurm.job_text()
    if slurm is not None and (word := _slurm.stamp()):
        return (word, _digest(f"agent|{slurm}"))
    identity = _agent_identity()
    if identity is None:
        return (0, 0)
    return (os.getppid(), _digest(f"agent|{identity}"))


def agent_lives(pid: int, digest: int) -> bool:
    """Whether the agent stamped as ``pid`` and ``digest`` (:func:`agent_stamp`) still runs on this host.

    A reused pid has another start time, hence another digest; zeros (no agent) never live. A Slurm job's stamp
    lives while the job will use this node's arenas again (:func:`~ignite_ext._slurm.brings_back`).

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.restart import agent_lives
        >>> agent_lives(0, 0), agent_lives(os.getpid(), 12345)
        (False, False)

    .. versionadded:: 0.4.0
    """
    if pid & _slurm.MARK:
        return _slurm.brings_back(pid)
    if pid <= 0:
        return False
    identity = process_identity(pid)
    return identity is not None and _digest(f"agent|{identity}") == digest


def cache_key(*parts: object) -> int:
    """The stamp of one cache's arena in a tier: a digest of what tells the caches of a job apart.

    Examples:
        >>> from ignite_ext.data.cache.restart import cache_key
        >>> cache_key("train", "train.py:12#1", 100, 2, "ram") == cache_key("train", "train.py:12#1", 100, 2, "ram")
        True
        >>> cache_key("train", "train.py:12#1", 100, 2, "ram") == cache_key("train", "train.py:12#1", 100, 2, "disk")
        False

    .. versionadded:: 0.3.0
    """
    return _digest("cache|" + "|".join(repr(p) for p in parts))


def leaving_for_a_restart(terminated: bool, handled_elsewhere: bool = False) -> bool:
    """Whether this process may end as an attempt that its agent restarts: failed or SIGTERMed, with a restart left.

    A failure is an exception no code caught (recorded before the exit handlers run) or a ``SIGTERM``
    (``terminated``); a restart is left while ``TORCHELASTIC_RESTART_COUNT`` is below ``TORCHELASTIC_MAX_RESTARTS``.
    In a Slurm job a ``SIGTERM`` may be a requeue: then the arena's agent (the job) says
    (:func:`agent_lives`).

    Args:
        terminated: whether this process was SIGTERMed (see :mod:`~ignite_ext.data.cache._sigterm`).
        handled_elsewhere: whether the program replaced the cache's ``SIGTERM`` handler with its own (it may
            have been SIGTERMed without the cache knowing).

    Examples:
        >>> import os
        >>> from ignite_ext.data.cache.restart import leaving_for_a_restart
        >>> os.environ.update(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="1")
        >>> leaving_for_a_restart(terminated=True), leaving_for_a_restart(terminated=False)
        (True, False)
        >>> os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # the last attempt
        >>> leaving_for_a_restart(terminated=True)
        False
        >>> for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        ...     del os.environ[name]

    .. versionadded:: 0.5.0
    .. versionchanged:: 0.6.0
       A Slurm job's ``SIGTERM``; ``handled_elsewhere``.
    """
    if _slurm.job_text() is not None and (terminated or handled_elsewhere):
        return True
    failed = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    if not (terminated or failed):
        return False
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return False
