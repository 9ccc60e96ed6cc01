"""The scheduler in a simulated world of up to 1,024 ranks on one machine: store load per rank, and wake-up latency.

Real gloo cannot start 1,024 ranks on two cores (a full mesh of connections, a process each importing torch), so
each rank is a process forked from one parent that imported torch and ignite_ext, joined into torch's ``fake``
process group (``torch.testing._internal.distributed.fake_pg``: collectives do nothing, which the scheduler's
store channel never uses) over one real TCPStore server, the one every rank's scheduler talks to. What is
measured is what a real cluster's store sees from the scheduler:

* **requests per rank** for one ``one_rank_first`` whose first rank works ``L`` seconds (0 and 5 s), counted by
  a proxy around each rank's store: the rank's own, and its heartbeat thread's (beats, wake-ups at slice ends,
  and the deletion of finished blocks' keys, which waits for the next beat); neither may grow with the world;
* **the server's load**: all ranks' requests over the block's length;
* **the wake-up spread**: from the first rank leaving its block to the last rank starting its own, which is
  what one ``multi_set`` fanning out to N wake keys, and N server-side waits returning, cost.

Ranks are grouped in simulated nodes of 8 (``LOCAL_RANK``, and the node size given to ignite, which would
otherwise find it with a gloo group of every rank). The heartbeat timeout and the log interval are the defaults
(30 s each; a wait's slice is the log interval), so a 5 s block is one slice. Each world size runs only if this
machine's free memory allows (8-9 MiB of private memory per simulated rank).
"""

from __future__ import annotations

import datetime
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks._store_server import StoreServer
from benchmarks.bench_scale import CountingStore, own_requests, start_and_reap

NAME = "world"
PER_RANK_MIB = 12  # what a forked simulated rank costs of its own (8-9 MiB private measured), with a margin
HOLD_S = 5.0
RANKS_PER_NODE = 8
#: The stall deadline of the wedged block.
STALL_S = 5.0
STALL_LAST = "stall: wedge to the last rank's error (s)"


def _free_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def _rank(rank: int, n: int, port: int, hold: float, out: str) -> None:
    import torch.distributed as dist
    from ignite.distributed.comp_models.native import _NativeDistModel
    from torch.distributed import distributed_c10d

    import ignite_ext.distributed as idist

    try:
        # ignite learns the node size with a gloo group of every rank (a full mesh of connections): a simulated
        # world says it instead, as LOCAL_RANK says the local rank.
        os.environ["LOCAL_RANK"] = str(rank % RANKS_PER_NODE)
        _NativeDistModel._compute_nproc_per_node = lambda self: RANKS_PER_NODE  # type: ignore[method-assign]
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=600))
        dist.init_process_group("fake", store=store, rank=rank, world_size=n)
        counts: Counter[str] = Counter()
        real = distributed_c10d._get_default_store
        proxy: dict[str, CountingStore] = {}
        distributed_c10d._get_default_store = lambda: proxy.setdefault("s", CountingStore(real(), counts))
        with idist.one_rank_first():
            pass  # every rank connected, beating
        rows: list[dict[str, Any]] = []
        for seconds in (0.0, hold):
            with idist.one_rank_first():
                pass  # in step: the measured block starts together
            counts.clear()
            entered = time.time()
            with idist.one_rank_first() as first:
                started = time.time()
                if first:
                    time.sleep(seconds)
                ended = time.time()
            rows.append(
                {
                    "entered": entered,
                    "started": started,
                    "ended": ended,
                    "left": time.time(),
                    "own": own_requests(counts),
                    "heartbeat": sum(counts.values()) - own_requests(counts),
                }
            )
        rows.append(_with_progress(idist, counts, hold))
        rows.append(_wedged(idist))
        Path(out, f"{rank}.json").write_text(json.dumps(rows))
    finally:
        os._exit(0)  # no interpreter teardown in 1,024 forked children


def _with_progress(idist: Any, counts: Counter[str], hold: float) -> dict[str, float]:
    """The ``hold`` s block again, its first rank reporting progress a hundred times a second (as a download does)."""
    from ignite_ext import progress

    with idist.one_rank_first():
        pass
    counts.clear()
    entered = time.time()
    with idist.one_rank_first() as first:
        started = time.time()
        if first:
            ends = time.monotonic() + hold
            while time.monotonic() < ends:
                progress.advance(65536, total=hold * 100 * 65536, what="downloading", unit="B")
                time.sleep(0.01)
        ended = time.time()
    own = own_requests(counts)
    return {
        "entered": entered,
        "started": started,
        "ended": ended,
        "left": time.time(),
        "own": own,
        "heartbeat": sum(counts.values()) - own,
    }


def _wedged(idist: Any) -> dict[str, float | None]:
    """A block whose first rank reports progress for 0.5 s, then none for ``STALL_S`` and two beats more."""
    from ignite_ext import progress
    from ignite_ext.distributed.liveness import beat_interval

    with idist.one_rank_first():
        pass
    wedged: float | None = None
    try:
        with idist.one_rank_first(stall_timeout=STALL_S) as first:
            if first:
                for _ in range(50):
                    progress.advance(what="tokenizing")
                    time.sleep(0.01)
                wedged = time.time()
                time.sleep(STALL_S + 2 * beat_interval() + 10.0)  # alive, wedged: the others give up meanwhile
        return {"wedged": wedged, "raised": None}
    except idist.RankStalledError:
        return {"wedged": wedged, "raised": time.time()}


def _world(n: int, hold: float) -> list[list[dict[str, float]]]:
    out = tempfile.mkdtemp(prefix="ignite_ext_bench_world_")
    ctx = mp.get_context("fork")
    gc.freeze()  # forked children then leave the parent's objects' pages shared
    # The server runs in a process of its own: its thread must not hold a lock while this process forks.
    with StoreServer() as server:
        procs = [ctx.Process(target=_rank, args=(r, n, server.port, hold, out), daemon=True) for r in range(n)]
        start_and_reap(procs)
    missing = [r for r in range(n) if not Path(out, f"{r}.json").exists()]
    if missing:
        raise RuntimeError(f"simulated ranks {missing[:8]}... of {n} did not finish")
    per_rank = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(n)]
    silent = [r for r, blocks in enumerate(per_rank) if not all(b["own"] for b in blocks[:3])]
    if silent:  # the collective channel ran (over the fake group, whose collectives do nothing): nothing measured
        raise RuntimeError(f"simulated ranks {silent[:8]}... of {n} sent no store request")
    return per_rank


def _summary(rows: list[dict[str, Any]], skipped: list[str]) -> str:
    plain = [r for r in rows if r["block (s)"] == HOLD_S and not r["progress"]]
    reported = [r for r in rows if r["progress"]]
    flat = [r["requests per rank (mean)"] for r in plain]
    sizes = [r["ranks"] for r in plain]
    last = plain[-1]
    summary = (
        f"Simulated worlds of {', '.join(map(str, sizes))} ranks (forked processes in torch's fake process group, "
        f"one real TCPStore): a rank's own store requests for one one_rank_first stay flat as the world grows "
        f"({', '.join(f'{v:g}' for v in flat)} for a {HOLD_S:g} s block; its heartbeat thread's a few more), so "
        f"the store's load grows linearly with N and no rank's with N. The wake-up spread after the first rank "
        f"leaves (median {last['wake-up spread, median (ms)']:g} ms at {last['ranks']} ranks) is here {last['ranks']} "
        f"processes taking turns on {os.cpu_count()} cores, not the store: it serves the {last['ranks']} wake-ups "
        "with one multi_set and the waits that return."
    )
    first_thread = "first rank's heartbeat thread"

    def listed(chosen: list[dict[str, Any]], column: str) -> str:
        return ", ".join(str(r[column]) for r in chosen)

    summary += (
        f" With the first rank reporting progress 100 times a second, its heartbeat thread sends "
        f"{listed(reported, first_thread)} requests in the {HOLD_S:g} s block (against "
        f"{listed(plain, first_thread)} without: one publication per beat at most), and the server's load is "
        f"{listed(reported, 'server load (requests/s)')} requests/s (against "
        f"{listed(plain, 'server load (requests/s)')}). A first rank wedged with stall_timeout={STALL_S:g} s is "
        f"reported on the last of its {', '.join(map(str, sizes))} ranks "
        f"{listed(reported, STALL_LAST)} s after its last advance (the deadline, at most a beat, the wake-up)."
    )
    if skipped:
        summary += " Not run for lack of memory: " + "; ".join(skipped) + "."
    return summary


def run(quick: bool = False) -> dict[str, Any]:
    os.environ["IGNITE_EXT_EARLY_HEARTBEAT"] = "0"  # beats start with the scheduler, on the counted store
    os.environ["IGNITE_EXT_SCHEDULER_CHANNEL"] = "store"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    import ignite_ext.distributed  # noqa: F401  (imported once, in the parent: the children share its pages)

    sizes = [16, 64] if quick else [64, 256, 1024]
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n in sizes:
        if _free_mib() < n * PER_RANK_MIB:
            skipped.append(f"{n} ranks (needs about {n * PER_RANK_MIB} MiB, {_free_mib()} MiB free)")
            continue
        per_rank = _world(n, HOLD_S)
        wedged = per_rank[0][3]["wedged"]
        raised = [p[3]["raised"] for p in per_rank]
        for i, hold in enumerate((0.0, HOLD_S, HOLD_S)):
            blocks = [p[i] for p in per_rank]
            requests = [b["own"] for b in blocks]
            beats = [b["heartbeat"] for b in blocks]
            span = max(b["left"] for b in blocks) - min(b["entered"] for b in blocks)
            released = blocks[0]["ended"]
            wakes = [b["started"] - released for b in blocks[1:]]
            rows.append(
                {
                    "label": f"{n} ranks, {hold:g} s block" + (", progress on" if i == 2 else ""),
                    "ranks": n,
                    "block (s)": hold,
                    "progress": i == 2,
                    "requests per rank (mean)": round(statistics.mean(requests), 1),
                    "requests per rank (max)": max(requests),
                    "heartbeat thread per rank (mean)": round(statistics.mean(beats), 1),
                    "server load (requests/s)": round((sum(requests) + sum(beats)) / span),
                    "block span (s)": round(span, 2),
                    "wake-up spread, median (ms)": round(1000 * statistics.median(wakes), 1),
                    "wake-up spread, max (ms)": round(1000 * max(wakes), 1),
                    "first rank's heartbeat thread": blocks[0]["heartbeat"],
                }
            )
        if wedged is None or any(r is None for r in raised[1:]):
            raise RuntimeError(f"{n} ranks: a wedged first rank was not reported on every rank: {raised[:8]}")
        late = [r - wedged for r in raised[1:] if r is not None]
        rows[-1][STALL_LAST] = round(max(late), 2)
        rows[-1]["stall: wedge to the first rank's error (s)"] = round(min(late), 2)
    summary = _summary(rows, skipped)
    return {
        "title": "Scheduler in a simulated world: requests per rank and wake-up spread as N grows",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "rows": rows,
        "summary": summary,
        "plot": {"x": "label", "y": ["requests per rank (mean)", "requests per rank (max)"], "kind": "bar"},
    }


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    print(json.dumps(result, indent=2))
