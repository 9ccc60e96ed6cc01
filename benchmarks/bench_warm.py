"""Warm restarts: the next job's first epoch with a persisted cache, against a cached epoch and a cold one.

The same samples as the cache-peers benchmark (float32 tensors of 64 KiB or 1 MiB, one raw file each plus a 2 ms
decode: :class:`benchmarks._cache_peers.SourceDataset`), one rank, 4 DataLoader workers (fork, started anew every
epoch so that every epoch pays the same start-up), batches of 16, shuffled. Three ways to run the epoch that
matters, taking turns in each round so that the machine's load hits them alike:

* ``cached epoch``: the epoch a job runs once its cache is warm (``CachedDataset``, RAM tier): the reference;
* ``next job, persisted``: a new ``CachedDataset(disk_dir=..., persist=True)`` over the persisted cache a job before
  left (construction, which checks a few samples against the dataset, then its first epoch);
* ``next job, not persisted``: a new ``CachedDataset`` (no persistence: a cold start), construction and first epoch.

Each reports seconds and the samples it loaded from the source (storage reads), and the ratio of its speed to the
cached epoch's in the same round (median over rounds). The page cache holds the persisted file (the next job on the
same node soon after; a node whose page cache was emptied reads the file from its disk once).

Then the peers' next runs, side by side (each variant in processes of its own, in the cache peers' environment,
``scripts/cache_peers_env.sh``; see :mod:`benchmarks._cache_peers` for the warm-restart variants): a first job
builds what the variant keeps (the persisted cache; LitData's chunks copied from a remote into its ``cache_dir``;
Mosaic's shards copied from a remote into its ``local``), then, in each round, a new job (new processes) times its
construction and first epoch and counts what it read from storage (samples loaded from the source, or bytes the
peers copied from their remote); ``time_vs_persisted`` is its time over the persisted ``CachedDataset``'s in the same
round (median over rounds; above 1: slower). A cold ``CachedDataset`` (no persistence) runs beside them.

Also the cost of adopting a cache of 1 M entries (every one published): the checks and the mapping when a job opens
a persisted cache (``Arena.open_persisted``), and when a restarted worker group adopts one (``Arena.create`` of the
same job and key).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

NAME = "warm"
#: (sample bytes, samples): 128 MiB per size in the full run.
SIZES = {"full": ((64 << 10, 2048), (1 << 20, 128)), "quick": ((64 << 10, 256), (1 << 20, 16))}
ROUNDS = {"full": 5, "quick": 2}
#: Rounds of the peers' next jobs (each a new group of processes: seconds apiece).
PEER_ROUNDS = {"full": 3, "quick": 2}
ADOPTED_ENTRIES = {"full": 1_000_000, "quick": 100_000}
VARIANTS = ("cached epoch", "next job, persisted", "next job, not persisted")


class _Counted:
    """The source dataset, counting its loads in shared memory (the DataLoader workers load)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.loads = mp.get_context("fork").Value("q", 0)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        with self.loads.get_lock():
            self.loads.value += 1
        return self.source[i]


def _epoch(ds: Any) -> int:
    from torch.utils.data import DataLoader

    from benchmarks._cache_peers import BATCH, WORKERS

    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS, multiprocessing_context="fork")
    return sum(len(batch[0]) for batch in loader)


def _timed(make: Any, counted: _Counted) -> tuple[float, int, Any]:
    """Seconds to construct (``make()``) and run one epoch, the source loads meanwhile, and the dataset."""
    before = counted.loads.value
    start = time.perf_counter()
    ds = make()
    seen = _epoch(ds)
    seconds = time.perf_counter() - start
    if seen != len(counted):
        raise RuntimeError(f"an epoch delivered {seen} samples, not {len(counted)}")
    return seconds, counted.loads.value - before, ds


def _size(sample_bytes: int, n: int, rounds: int, tmp: str) -> list[dict[str, Any]]:
    from benchmarks._cache_peers import SourceDataset, write_source
    from ignite_ext.data import CachedDataset

    source_dir, disk_dir = os.path.join(tmp, "source"), os.path.join(tmp, "disk")
    write_source(source_dir, n, sample_bytes // 4)
    os.makedirs(disk_dir)
    counted = _Counted(SourceDataset(source_dir, n))
    warm = CachedDataset(counted, capacity_bytes=2 * n * sample_bytes)
    _epoch(warm)  # the job before: its RAM cache filled ...
    first = CachedDataset(counted, disk_dir=disk_dir, persist=True)
    _epoch(first)  # ... and the persisted cache written, as the job before would leave it
    first.close()
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    loads: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for v in order:
            if v == "cached epoch":
                s, loaded, _ = _timed(lambda: warm, counted)
            else:
                persist = v == "next job, persisted"
                s, loaded, ds = _timed(
                    lambda p=persist: (
                        CachedDataset(counted, disk_dir=disk_dir, persist=True)
                        if p
                        else CachedDataset(counted, capacity_bytes=2 * n * sample_bytes)
                    ),
                    counted,
                )
                ds.close()
            seconds[v].append(s)
            loads[v].append(loaded)
    warm.close()
    label = f"{sample_bytes >> 10} KiB" if sample_bytes < (1 << 20) else f"{sample_bytes >> 20} MiB"
    rows = []
    for v in VARIANTS:
        speed = statistics.median(c / s for c, s in zip(seconds["cached epoch"], seconds[v], strict=True))
        rows.append(
            {
                "label": f"{label} {v}",
                "sample": label,
                "variant": v,
                "seconds": round(statistics.median(seconds[v]), 3),
                "speed_vs_cached_epoch": round(speed, 3),
                "storage_reads": max(loads[v]),
                "samples": n,
            }
        )
    shutil.rmtree(source_dir)
    shutil.rmtree(disk_dir)
    return rows


def _adoption(n: int, tmp: str) -> list[dict[str, Any]]:
    """Seconds to open a persisted cache of ``n`` published entries, and to adopt one in a restarted group."""
    from ignite_ext.data.cache import restart
    from ignite_ext.data.cache.arena import Arena

    directory = os.path.join(tmp, "adopt")
    os.makedirs(directory)
    arena, _ = Arena.open_persisted(directory, n, 1, key=12345, capacity=64 * n)
    assert arena is not None
    for i in range(n):  # the smallest entries: what the checks cost grows with their number, not their size
        offset = arena.reserve(i, 8)
        assert offset is not None
        arena.publish(i, offset, 8)
    arena.close()
    start = time.perf_counter()
    again, adopted = Arena.open_persisted(directory, n, 1, key=12345, capacity=64 * n)
    persisted_s = time.perf_counter() - start
    assert again is not None and adopted and again.lookup(n - 1) is not None
    again.discard()
    # A restarted group: the arena of a dead creator of the same job and key (its creator here: a forked child).
    job = restart.job_key() or 7
    pid = os.fork()
    if pid == 0:
        try:
            made = Arena.create(n, 64 * n, directory=directory, job=job, key=99)
            for i in range(n):
                offset = made.reserve(i, 8)
                assert offset is not None
                made.publish(i, offset, 8)
        finally:
            os._exit(0)  # no cleanup: the files stay, as after a SIGKILL
    os.waitpid(pid, 0)
    start = time.perf_counter()
    adopted_arena = Arena.create(n, 64 * n, directory=directory, job=job, key=99)
    restart_s = time.perf_counter() - start
    ok = adopted_arena.lookup(n - 1) is not None
    adopted_arena.close()
    shutil.rmtree(directory)
    if not ok:
        raise RuntimeError("the restarted group's arena was not adopted")
    return [
        {"label": f"open a persisted cache of {n} entries", "variant": "adoption", "seconds": round(persisted_s, 3)},
        {"label": f"adopt a restart's cache of {n} entries", "variant": "adoption", "seconds": round(restart_s, 3)},
    ]


PEER_VARIANTS = ("CachedDataset", "CachedDataset-persist", "LitData-remote", "Mosaic-remote")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _peers(python: str, sample_bytes: int, n: int, rounds: int, tmp: str) -> list[dict[str, Any]]:
    """The next job's first epoch of each warm-restart variant, against CachedDataset's cached epoch per round."""
    from benchmarks._cache_peers import write_source
    from benchmarks.bench_cache_peers import Group

    source = os.path.join(tmp, "source")
    write_source(source, n, sample_bytes // 4)
    stores = {v: os.path.join(tmp, v) for v in PEER_VARIANTS}
    first: dict[str, list[float]] = {v: [] for v in PEER_VARIANTS}
    reads: dict[str, list[int]] = {v: [] for v in PEER_VARIANTS}

    def job(v: str) -> tuple[float, int]:
        store = stores[v]
        loads, copied = os.path.join(store, "loads"), _dir_bytes(store) - _dir_bytes(os.path.join(store, "disk"))
        before = os.path.getsize(loads) if os.path.exists(loads) else 0
        group = Group(python, v, source, n, sample_bytes // 4, 1, tmp, extra_env={"BENCH_WARM_STORE": store})
        try:
            setup = max(a["s"] for a in group.ask("setup"))
            epoch = group.epoch(n)
        finally:
            group.close()
        loaded = (os.path.getsize(loads) if os.path.exists(loads) else 0) - before
        fetched = _dir_bytes(store) - _dir_bytes(os.path.join(store, "disk")) - copied - loaded
        return setup + epoch, loaded * sample_bytes + max(0, fetched)

    for v in PEER_VARIANTS:
        os.makedirs(stores[v])
        job(v)  # the job before: what the variant keeps is built
    for r in range(rounds):
        for v in PEER_VARIANTS[r % 4 :] + PEER_VARIANTS[: r % 4]:
            seconds, read = job(v)
            first[v].append(seconds)
            reads[v].append(read)
    ours = first["CachedDataset-persist"]
    label = f"{sample_bytes >> 10} KiB" if sample_bytes < (1 << 20) else f"{sample_bytes >> 20} MiB"
    shutil.rmtree(source)
    return [
        {
            "label": f"{label} next job {v}",
            "sample": label,
            "variant": f"next job, {v}",
            "seconds": round(statistics.median(first[v]), 3),
            "time_vs_persisted": round(statistics.median(s / o for s, o in zip(first[v], ours, strict=True)), 2),
            "storage_MiB": round(max(reads[v]) / (1 << 20), 1),
            "samples": n,
        }
        for v in PEER_VARIANTS
    ]


def run(quick: bool = False, python: str | None = None) -> dict[str, Any]:
    """Both sample sizes, then the adoption of a large cache; ``quick``: 16 MiB per size, 2 rounds, 100 k entries."""
    kind = "quick" if quick else "full"
    rows: list[dict[str, Any]] = []
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on fewer cores
    with tempfile.TemporaryDirectory(prefix="bench_warm_", dir=os.environ.get("IGNITE_EXT_BENCH_DISK")) as tmp:
        for sample_bytes, n in SIZES[kind]:
            rows += _size(sample_bytes, n, ROUNDS[kind], os.path.join(tmp, str(sample_bytes)))
        rows += _adoption(ADOPTED_ENTRIES[kind], tmp)
        if python is None:
            from benchmarks.bench_cache_peers import peers_python

            python, why_not = peers_python()
            if python is None:
                raise RuntimeError(f"the cache peers' environment cannot be made: {why_not}")
        for sample_bytes, n in SIZES[kind]:
            rows += _peers(python, sample_bytes, n, PEER_ROUNDS[kind], os.path.join(tmp, f"peers_{sample_bytes}"))
    epochs = [r for r in rows if r["variant"] == "next job, persisted"]
    cold = [r for r in rows if r["variant"] == "next job, not persisted"]
    adoption = [r for r in rows if r["variant"] == "adoption"]
    peers = [r for r in rows if "time_vs_persisted" in r and r["variant"] != "next job, CachedDataset-persist"]
    summary = (
        "The next job's first epoch with persist=True, as fast as a cached epoch: "
        + ", ".join(f"{r['sample']} {r['speed_vs_cached_epoch']:.2f}x" for r in epochs)
        + " (goal >= 0.95x), reading "
        + ", ".join(f"{r['storage_reads']}" for r in epochs)
        + " samples from storage (the checks on opening; a cold start reads "
        + ", ".join(f"{r['storage_reads']}" for r in cold)
        + " and runs at "
        + ", ".join(f"{r['speed_vs_cached_epoch']:.2f}x" for r in cold)
        + "). "
        + "; ".join(f"{r['label']}: {r['seconds']} s" for r in adoption)
        + ". The next job (new processes) against the persisted CachedDataset's, construction and first epoch, "
        "times over ours: "
        + ", ".join(
            f"{r['sample']} {r['variant'].removeprefix('next job, ')} {r['time_vs_persisted']:.2f}x "
            f"({r['storage_MiB']} MiB from storage)"
            for r in peers
        )
        + "."
    )
    return {
        "title": "Warm restarts: the next job's first epoch, and adopting a cache",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, 4 workers, batch 16, one rank",
        "rows": rows,
        "summary": summary,
        "plot": {"x": "label", "y": ["time_vs_persisted"], "kind": "bar", "complete_rows": True},
    }


if __name__ == "__main__":
    from benchmarks._report import print_result

    print_result(run(quick="--quick" in sys.argv[1:]))
