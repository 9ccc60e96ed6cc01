"""What every rank of a simulated-host job runs: ``torchrun ... -m tests.hosts._rank MODULE:FUNCTION ARGS_JSON``.

The rank joins the gloo process group (timeout: ``IGNITE_EXT_HOSTS_PG_TIMEOUT`` seconds), calls the function with
the JSON list of arguments, and writes what it returned or raised to ``$IGNITE_EXT_HOSTS_OUT/rank<r>.json`` by an
atomic rename, so that the test reads whole records only, also of ranks whose peers died. Then it runs its exit
handlers (rank 0 waits there, bounded, for the others to read its last outcome) and ends at once, like the ranks
of ``tests._world``: a rank whose peers are gone must not block in a destructor.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.hosts._jobs import OUT_ENV, PG_TIMEOUT_ENV

__all__ = ["main", "mark", "out_dir"]


def out_dir() -> Path:
    """The job's directory on the shared directory, as this rank's host sees it."""
    return Path(os.environ[OUT_ENV])


def _publish(name: str, text: str) -> None:
    path = out_dir() / name
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def mark(name: str) -> None:
    """Tell the test that this rank got to ``name`` (it reads when, by the machine's monotonic clock)."""
    _publish(f"{name}.{os.environ['RANK']}", repr(time.monotonic()))


def main(argv: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for stacks at a deadline
    target, args = argv[0], json.loads(argv[1])
    record: dict[str, Any]
    try:
        import ignite.distributed as idist

        idist.initialize("gloo", timeout=timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "60"))))
        module, function = target.split(":")
        record = {"ok": True, "value": getattr(importlib.import_module(module), function)(*args)}
    except BaseException as exc:  # report everything, SystemExit included
        record = {"ok": False, "exc_type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    _publish(f"rank{os.environ['RANK']}.json", json.dumps(record))
    sys.stdout.flush()
    atexit._run_exitfuncs()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
