"""One rank of the Slurm death tests: a rank dies (SIGKILL, or its node lost) while the others wait for it.

``srun -n 2 python -m tests.slurm._death_body MODE`` forms the group with ``idist.Parallel(backend="gloo")``,
runs a first block (every keeper watches its rank from then on), then, by ``MODE``:

* ``kill``: rank 1 SIGKILLs itself half a second later;
* ``checkpoint``: each rank handles ``SIGTERM`` as preemption handlers do (a flag, then a checkpoint), prints
  ``ready RANK JOB KEEPER_PID``, waits for the signal and prints ``stopping RANK``; then rank 1 dies while
  "checkpointing", half a second later;
* ``lost``: each rank prints ``ready RANK``, and rank 2 (the second node's first) runs a block for 300 s: the
  test cuts that node off meanwhile.

The others wait for that rank inside ``one_rank_first(rank=...)``; each prints ``rank R raised TYPE after SECONDS
s at UNIX_TIME: MESSAGE``.
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


def _wait_for_sigterm(rank: int) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    idist.barrier()  # every rank's handler is in place
    _say(f"ready {rank} {os.environ['SLURM_JOB_ID']} {_keeper_pid()}")
    # Short waits: the signal may land on another of the rank's threads, which does not wake a long one.
    deadline = time.monotonic() + 90
    while not stop.wait(timeout=0.1):
        if time.monotonic() > deadline:
            _say(f"rank {rank} got no SIGTERM")
            sys.exit(2)
    _say(f"stopping {rank}")


def _body(local_rank: int, mode: str) -> None:
    rank = idist.get_rank()
    with idist.one_rank_first():  # its entry waits until this rank's keeper watches it
        pass
    if mode == "checkpoint":
        _wait_for_sigterm(rank)
    if mode == "lost":
        _say(f"ready {rank}")
    elif rank == 1:
        time.sleep(0.5)  # rank 0 waits in the block by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        with idist.one_rank_first(rank=2 if mode == "lost" else 1) as first:
            if first:
                time.sleep(300)
    except Exception as exc:
        seconds, message = time.monotonic() - start, str(exc).splitlines()[0][:200]
        _say(f"rank {rank} raised {type(exc).__name__} after {seconds:.2f} s at {time.time():.2f}: {message}")
        raise


def main() -> None:
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(_body, sys.argv[1])


if __name__ == "__main__":
    main()
