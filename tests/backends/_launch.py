"""Run one body of :mod:`tests.backends._bodies` on a world started by ``idist.Parallel`` (Horovod, XLA).

Used as ``python -m tests.backends._launch BACKEND NPROC OUTDIR BODY ARGS_JSON`` from a parent that enforces a
hard deadline on the whole process tree. Every rank writes what it returned or raised to
``OUTDIR/rank<r>.pkl`` (atomically), so the parent learns each rank's outcome even when some ranks fail.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from typing import Any


def _rank_main(local_rank: int, outdir: str, body: str, args: list[Any]) -> None:
    import ignite_ext.distributed as idist
    from tests.backends import _bodies

    record: tuple[Any, ...]
    try:
        record = ("ok", getattr(_bodies, body)(*args))
    except BaseException as exc:  # report everything; the parent decides
        record = ("err", type(exc).__name__, str(exc), traceback.format_exc())
    path = os.path.join(outdir, f"rank{idist.get_rank()}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(record, f)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    backend, nproc, outdir, body, args_json = argv
    import ignite_ext.distributed as idist

    with idist.Parallel(backend=backend, nproc_per_node=int(nproc)) as parallel:
        parallel.run(_rank_main, outdir, body, json.loads(args_json))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
