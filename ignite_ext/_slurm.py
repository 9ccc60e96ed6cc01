"""What the package asks of Slurm: whether a job will use a node's cache again (a requeued job adopts it).

Preemption with requeue and ``scontrol requeue`` end a batch job's run with ``SIGTERM`` and start it again
later, with the same job id and ``SLURM_RESTART_COUNT`` one higher, often on the same nodes. An arena made in a
Slurm job is stamped with the job (:func:`stamp`: its id and its run's restart count); whether the job will use
it again is asked of Slurm (:func:`brings_back`, one ``scontrol show job`` call), only when it matters: at a
``SIGTERM``, and in a sweep of an arena whose creator is gone.

The controller marks a requeue before it signals the job: at the ``SIGTERM``, ``scontrol show job`` says
``Restarts`` one higher than the run's own count, while a cancelled job keeps its count. So a cancelled job, a
job that is not requeueable and one that ends by its time limit leave nothing; a requeued one leaves its node
cache, and a sweep removes it once the job runs elsewhere, has ended or is gone from Slurm's memory.

.. versionadded:: 0.6.0
"""

from __future__ import annotations

import os
import re
import socket
import subprocess

__all__ = ["MARK", "brings_back", "job_text", "stamp"]

#: Set in a Slurm stamp (a header's agent word): above any process id (at most 2**22), so no pid is taken for one.
MARK = 1 << 62
#: Seconds one ``scontrol`` call may take: a ``SIGTERM``'s handling must end before Slurm's ``KillWait``.
QUERY_TIMEOUT = 5.0
#: The states of a job that runs (on the nodes of its ``NodeList``).
_RUNNING = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT"})
#: The states of a job that waits to run again.
_WAITING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED"})


def _job_id() -> int | None:
    try:
        return int(os.environ["SLURM_JOB_ID"])
    except (KeyError, ValueError):
        return None


def job_text() -> str | None:
    """What names this process's Slurm job: its cluster and id; None outside a Slurm job.

    Examples:
        >>> import os
        >>> from ignite_ext._slurm import job_text
        >>> job_text() is None or job_text().startswith("slurm|")
        True
    """
    job = _job_id()
    if job is None:
        return None
    return f"slurm|{os.environ.get('SLURM_CLUSTER_NAME', '')}|{job}"


def stamp() -> int:
    """This process's Slurm job and run as an arena's agent word (:data:`MARK` set); 0 outside a Slurm job.

    Examples:
        >>> import os
        >>> from ignite_ext._slurm import MARK, stamp
        >>> os.environ.update(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1")
        >>> word = stamp()
        >>> bool(word & MARK), word & 0xFFFFFFFF, (word >> 32) & 0xFFFF
        (True, 4242, 1)
        >>> for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        ...     del os.environ[name]
        >>> stamp()
        0
    """
    job = _job_id()
    if job is None or not 0 < job <= 0xFFFFFFFF:
        return 0
    try:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        restarts = 0
    return MARK | (min(restarts, 0xFFFF) << 32) | job


def _scontrol(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=QUERY_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _this_node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def brings_back(word: int) -> bool:
    """Whether the Slurm job stamped ``word`` (:func:`stamp`) will use this node's arena again: ask Slurm.

    Yes while its run goes on on this node (a torchrun restart inside it, a later step), while it waits to run
    again (requeued, preempted), and while it runs again on this node. No once it runs on other nodes only, ends,
    or Slurm no longer knows it, and where Slurm cannot be asked (no ``scontrol``, no answer in
    :data:`QUERY_TIMEOUT`): then the arena is swept, and a requeued run starts with an empty cache.

    Examples:
        >>> from ignite_ext._slurm import brings_back
        >>> brings_back(0)
        False
    """
    if not word & MARK:
        return False
    job, restarts = word & 0xFFFFFFFF, (word >> 32) & 0xFFFF
    shown = _scontrol("show", "job", "-o", str(job))
    state = re.search(r"\bJobState=(\S+)", shown or "")
    count = re.search(r"\bRestarts=(\d+)", shown or "")
    if state is None or count is None:
        return False
    if state.group(1) in _WAITING:
        return True
    if state.group(1) == "COMPLETING":  # its run ends: requeued if Slurm counted one more restart first
        return int(count.group(1)) > restarts
    if state.group(1) not in _RUNNING:
        return False
    nodes = re.search(r"\bNodeList=(\S+)", shown or "")
    names = _scontrol("show", "hostnames", nodes.group(1)) if nodes else None
    return names is not None and _this_node() in names.split()
