"""Run bodies (module-level functions) on a world started by ``idist.Parallel`` (Horovod, XLA).

``python -m tests.backends._launch BACKEND NPROC JOBDIR`` starts the world once and serves jobs: starting a
Horovod world costs tens of seconds on a small machine (every rank imports torch and horovod), so one world runs
many bodies. The parent (``tests._world.LaunchedWorld``) publishes ``JOBDIR/job<n>.pkl`` (``(fn, args)``, by an
atomic rename; ``fn`` is pickled by reference, so every rank imports its module); every rank runs the jobs in
order and writes what it returned or raised to ``JOBDIR/job<n>.rank<r>.pkl``, so the parent learns each rank's
outcome even when some ranks fail. A job ``(None, ())`` ends the world. The parent enforces every deadline and
kills the whole process tree when one passes (or when a body broke the world).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def publish(path: Path, obj: Any) -> None:
    """Write ``obj`` pickled to ``path`` so that readers never see a partial file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps(obj))
    os.replace(tmp, path)


def _serve(local_rank: int, jobdir: str) -> None:
    import ignite_ext.distributed as idist

    rank = idist.get_rank()
    n = 0
    while True:
        job = Path(jobdir, f"job{n}.pkl")
        while not job.exists():
            time.sleep(0.02)
        record: tuple[Any, ...]
        try:
            fn, args = pickle.loads(job.read_bytes())  # imports fn's module: that may fail too
            if fn is None:
                return
            record = ("ok", fn(*args))
        except BaseException as exc:  # report everything; the parent decides
            record = ("err", type(exc).__name__, str(exc), traceback.format_exc())
        publish(Path(jobdir, f"job{n}.rank{rank}.pkl"), record)
        n += 1


def main(argv: list[str]) -> int:
    backend, nproc, jobdir = argv
    import ignite_ext.distributed as idist

    with idist.Parallel(backend=backend, nproc_per_node=int(nproc)) as parallel:
        parallel.run(_serve, jobdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
