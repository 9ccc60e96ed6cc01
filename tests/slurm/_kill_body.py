"""One rank of the kill-on-bad-exit test: rank 1 is SIGKILLed while rank 0 waits for it in a block.

``srun -n 2 --kill-on-bad-exit=1 python -m tests.slurm._kill_body`` forms the group with
``idist.Parallel(backend="gloo")``; after a first block, rank 1 SIGKILLs itself half a second later, and rank 0,
waiting for it inside ``one_rank_first(rank=1)``, prints ``rank 0 raised TYPE after SECONDS s: MESSAGE``, unless
srun's ``SIGTERM`` ends it first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import ignite_ext.distributed as idist

__all__ = ["main"]


def _body(local_rank: int) -> None:
    rank = idist.get_rank()
    with idist.one_rank_first():  # every rank's keeper watches it from here on
        pass
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits in the block by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        with idist.one_rank_first(rank=1):
            pass
    except Exception as exc:
        seconds = time.monotonic() - start
        sys.stdout.write(f"rank {rank} raised {type(exc).__name__} after {seconds:.2f} s: {str(exc)[:300]}\n")
        sys.stdout.flush()
        raise


def main() -> None:
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(_body)


if __name__ == "__main__":
    main()
