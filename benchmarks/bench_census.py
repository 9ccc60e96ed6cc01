"""SharedPath's census over simulated hosts: filesystem operations per rank and census time as the world grows.

Real gloo ranks, two per simulated host: each rank gives itself a UTS namespace with its host's name (the host key
is hostname, boot id and mount namespace), so ranks of different hosts can only meet through the filesystem. Two
censuses per world: on one directory every rank shares (one leader for all), and on a directory of each host's
own (one leader per host). Every rank counts its ``stat``, ``lstat``, ``mkdir``, ``open``, ``link``, ``unlink``,
``listdir`` and ``scandir`` calls during the census: they must not grow with the world (the first design looked
up every other rank's marker: N + 5 per rank, O(N²) in all).
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.bench_scale import run_ranks

NAME = "census"
PER_HOST = 2
COUNTED = ("stat", "lstat", "mkdir", "open", "link", "unlink", "listdir", "scandir")


def _host(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x04000000) != 0 or libc.sethostname(name.encode(), len(name)) != 0:  # CLONE_NEWUTS
        raise OSError(ctypes.get_errno(), f"cannot simulate host {name}: {os.strerror(ctypes.get_errno())}")
    assert socket.gethostname() == name


#: The names of the failure detector's threads (see :mod:`ignite_ext.distributed.liveness`).
_LIVENESS_THREADS = ("ignite_ext-heartbeat", "ignite_ext-group-watch", "ignite_ext-cuts")


@contextmanager
def counting_fs_ops() -> Iterator[dict[str, int]]:
    """Count this process's calls of the filesystem operations a census may make, while inside.

    The failure detector's threads are not the census: a rank's keeper starts as its group forms, reading the
    rank's process identity under ``/proc``, maybe while the census runs.
    """
    counts = dict.fromkeys(COUNTED, 0)

    def census() -> bool:
        return not threading.current_thread().name.startswith(_LIVENESS_THREADS)

    originals = {name: getattr(os, name) for name in COUNTED}
    real_open = builtins.open

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += census()
            return originals[name](*args, **kwargs)

        return call

    def open_counted(*args: Any, **kwargs: Any) -> Any:
        counts["open"] += census()
        return real_open(*args, **kwargs)

    for name in COUNTED:
        setattr(os, name, counting(name))
    builtins.open = open_counted
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(os, name, fn)
        builtins.open = real_open


def _census(path: str) -> tuple[dict[str, int], float, bool]:
    import ignite_ext.distributed as idist

    with counting_fs_ops() as counts:
        start = time.perf_counter()
        with idist.rank_scheduler(order=idist.SharedPath(path)) as turn:
            took = time.perf_counter() - start
            leader = bool(turn)
    return counts, took, leader


def _rank(local_rank: int, out: str, shared: str, own: str) -> None:
    import ignite_ext.distributed as idist

    rank = idist.get_rank()
    _host(f"simhost{rank // PER_HOST}")
    with idist.one_rank_first():
        pass  # connections and heartbeats: not part of the census
    rows = {}
    for kind, path in (("shared", shared), ("per host", f"{own}/{rank // PER_HOST}")):
        idist.barrier()
        counts, took, leader = _census(path)
        rows[kind] = {"ops": sum(counts.values()), "lookups": counts["listdir"] + counts["scandir"], "s": took}
        rows[kind]["leader"] = leader
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))


def run(quick: bool = False) -> dict[str, Any]:
    sizes = [4, 8] if quick else [4, 8, 16]
    rows: list[dict[str, Any]] = []
    for n in sizes:
        base = Path(tempfile.mkdtemp(prefix="ignite_ext_bench_census_"))
        (base / "shared").mkdir()
        out = run_ranks(_rank, n, {}, str(base / "shared"), str(base / "own"))
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(n)]
        for kind in ("shared", "per host"):
            seen = [p[kind] for p in per_rank]
            rows.append(
                {
                    "label": f"{n} ranks / {n // PER_HOST} hosts, {kind}",
                    "ranks": n,
                    "directory": kind,
                    "leaders": sum(s["leader"] for s in seen),
                    "fs ops per rank (max)": max(s["ops"] for s in seen),
                    "fs ops per rank (mean)": round(sum(s["ops"] for s in seen) / n, 1),
                    "directory listings": sum(s["lookups"] for s in seen),
                    "first design (N + 5 per rank)": n + 5,
                    "census time, max (ms)": round(1000 * max(s["s"] for s in seen), 1),
                }
            )
    worst = max(r["fs ops per rank (max)"] for r in rows)
    summary = (
        f"SharedPath's census over {', '.join(str(n) for n in sizes)} gloo ranks on simulated hosts of "
        f"{PER_HOST} ranks (UTS namespaces): at most {worst} filesystem operations per rank whatever the world, "
        "no directory listing, one leader for the shared directory and one per host for the hosts' own "
        "(the first design: N + 5 per rank, O(N²) in all)."
    )
    return {
        "title": "SharedPath census on simulated hosts: filesystem operations per rank",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "rows": rows,
        "summary": summary,
        "plot": {"x": "label", "y": ["fs ops per rank (max)", "first design (N + 5 per rank)"], "kind": "bar"},
    }


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    for row in result["rows"]:
        print(row)
    print(result["summary"])
