"""One rank of the handled-SIGTERM test: it handles ``SIGTERM`` to save a checkpoint, as preemption handlers do.

``srun -n 2 python -m tests.slurm._checkpoint_body`` forms the group with ``idist.Parallel(backend="gloo")``;
each rank installs a ``SIGTERM`` handler that sets a flag, prints ``ready RANK JOB KEEPER_PID`` and waits for
the flag, then prints ``stopping RANK``. Then rank 1 dies while "checkpointing" (it SIGKILLs itself half a second
later), and rank 0 waits for it inside ``one_rank_first(rank=1)``: it prints ``rank 0 raised TYPE after SECONDS
s: MESSAGE``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import ignite_ext.distributed as idist

__all__ = ["main"]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: the ranks share srun's pipe
    sys.stdout.flush()


def _keeper_pid() -> int:
    """This rank's keeper: its child process that runs the keeper's module (0 if none)."""
    for child in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in child.read_text().split():
            try:
                if b"keeper.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except OSError:
                continue
    return 0


def _body(local_rank: int) -> None:
    rank = idist.get_rank()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    idist.barrier()  # every rank's handler is in place, and its keeper watches it (the block's entry waits for it)
    deadline = time.monotonic() + 30
    while not (keeper := _keeper_pid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    _say(f"ready {rank} {os.environ['SLURM_JOB_ID']} {keeper}")
    # Short waits: the signal may land on another of the rank's threads, which does not wake a long one.
    deadline = time.monotonic() + 90
    while not stop.wait(timeout=0.1):
        if time.monotonic() > deadline:
            _say(f"rank {rank} got no SIGTERM")
            sys.exit(2)
    _say(f"stopping {rank}")
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits in the block by now
        os.kill(os.getpid(), signal.SIGKILL)  # a death while saving the checkpoint
    start = time.monotonic()
    try:
        with idist.one_rank_first(rank=1):
            pass
    except Exception as exc:
        seconds = time.monotonic() - start
        _say(f"rank {rank} raised {type(exc).__name__} after {seconds:.2f} s: {str(exc).splitlines()[0][:200]}")
        raise


def main() -> None:
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(_body)


if __name__ == "__main__":
    main()
