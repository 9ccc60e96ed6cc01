"""Restarts within a job: the caches a restarted worker group adopts from the attempt before it.

torchrun restarts its worker group (``--max-restarts``) with new processes, and the caches of the attempt before
stay on the node: their creators are dead and nobody holds their liveness lock, so the next cache created there
would sweep them, and the new attempt would load its whole shard from storage again. Instead, an arena is stamped
when it is created with two header words, and a cache of the restarted group adopts the arena of the attempt
before whose stamps are its own:

* the *job* (:func:`job_key`): set only in an elastic worker (``TORCHELASTIC_RUN_ID`` in the environment, as
  torchrun sets it), from the run id, this host's boot, and the agent that started this process (its parent:
  pid and start time). A restarted group has the same agent; a later job has another one, even with the same run
  id (torchrun's default ``rdzv_id`` is ``none`` for every job), so it adopts nothing of an earlier job;
* the *cache* (:func:`cache_key`): its name, its construction site (unless ``name=`` was given), its length, its
  number of counter rows, the sampled fingerprint of a node cache, the local rank for a rank's own cache, and the
  tier. Within a job the code is the same, so each cache of the attempt before has exactly one successor.

Adoption happens under the user's creation lock of the directory, before any sweep: the arena and its lock file are
renamed to the adopter's names (an arena the adopter's sweep must not take for stale), then checked
(:meth:`Arena.consistent <ignite_ext.data.cache.arena.Arena.consistent>`: the layout of its header, and every
published entry inside the used part of the data area); its hit and miss counters start again at zero, its entries
and bytes stay. What a writer had not published when it was killed stays unpublished, so no reader ever sees it.
An arena that fails a check is deleted and the cache starts empty. Arenas of the same job that no cache adopts
(yet) are left to their successors by every sweep while the job's agent lives: never more than the attempt before
held; the first cache created after the job ended sweeps them.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import contextlib
import hashlib
import os

__all__ = ["NO_JOB", "cache_key", "job_key"]

#: Stamped where no job is known (not an elastic worker): never adopted, swept as soon as its creator is gone.
NO_JOB = 0


def _digest(text: str) -> int:
    """A non-zero 63-bit digest of ``text`` (a header word that :data:`NO_JOB` cannot be)."""
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    return value or 1


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, field 22 of ``/proc/<pid>/stat``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


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
    if not run_id:
        return NO_JOB
    agent = os.getppid()
    started = _start_time(agent)
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    if started is None or not boot:  # nothing tells this job's agent from a later one's: adopt nothing
        return NO_JOB
    return _digest(f"job|{boot}|{agent}|{started}|{run_id}")


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
