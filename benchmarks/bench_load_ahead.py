"""Loading the next epoch's arrivals ahead: does it pay? Side by side with a cache that only follows, in one run.

One rank's view of shards that mix (``ShardedDistributedSampler(num_replicas=4, rank=0, mix=f)``) over a
``CachedDataset`` that follows the shard: each epoch ``f`` of the shard arrives and is a miss on its first read.
With ``load_ahead=True`` a low-priority process loads those samples during the epoch before, so they are hits. The
question is whether that shortens the epochs users wait for, and it depends on what a load costs:

* ``storage``: a load waits 4 ms on storage (a sleep: the CPU is free meanwhile), as reading a file over a
  network filesystem does;
* ``cpu``: a load spends 4 ms of CPU (decoding), on a machine whose cores the workers and the training step
  already use.

Each epoch runs a DataLoader (2 workers, fork, started anew) over the rank's shard, with a training step of 3 ms
of CPU per batch in the main process. Reported per epoch: hits, storage reads (misses plus loads ahead) and the
epoch's time; epochs 1 to the last, summed, compared between the two runs of the same load kind and ``f`` (the
time with loading ahead over the time without; below 1 it pays). Both runs of a pair take turns on the machine.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks._report import print_result
from ignite_ext.data import CachedDataset, ShardedDistributedSampler

NAME = "load_ahead"

LOAD_SECONDS = 0.004
STEP_SECONDS = 0.003
BATCH = 16


class SlowSource:
    """Sample ``i``: 256 floats; each load costs :data:`LOAD_SECONDS`, waiting (``storage``) or computing (``cpu``)."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        end = time.perf_counter() + LOAD_SECONDS
        if self.kind == "storage":
            time.sleep(LOAD_SECONDS)
        else:
            while time.perf_counter() < end:
                pass
        return torch.full((256,), float(index))


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _epochs(kind: str, mix: float, ahead: bool, n: int, epochs: int) -> list[dict[str, Any]]:
    ds = CachedDataset(SlowSource(n, kind), capacity_bytes=64 << 20, name=f"bench-ahead-{kind}-{mix}-{ahead}")
    sampler = ShardedDistributedSampler(ds, num_replicas=4, rank=0, seed=0, mix=mix, load_ahead=ahead)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    rows, before = [], ds.stats()
    try:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            start = time.perf_counter()
            for batch in loader:
                _busy(STEP_SECONDS)
                assert batch.shape[0] <= BATCH
            seconds = time.perf_counter() - start
            now = ds.stats()
            delta = now - before
            before = now
            rows.append(
                {
                    "hits": delta.hits,
                    "reads": delta.misses + delta.loaded_ahead,
                    "seconds": seconds,
                    "held": now.entries - now.evictions,
                }
            )
    finally:
        ds.close()
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    n, epochs = (1_600, 4) if quick else (4_000, 8)
    rows = []
    for kind in ("storage", "cpu"):
        for mix in (0.05, 0.25):
            plain = _epochs(kind, mix, False, n, epochs)
            ahead = _epochs(kind, mix, True, n, epochs)
            later_plain = sum(r["seconds"] for r in plain[1:])
            later_ahead = sum(r["seconds"] for r in ahead[1:])
            rows.append(
                {
                    "load": kind,
                    "mix": mix,
                    "hit_pct_follow": round(100 * sum(r["hits"] for r in plain[1:]) / (n // 4) / (epochs - 1), 1),
                    "hit_pct_ahead": round(100 * sum(r["hits"] for r in ahead[1:]) / (n // 4) / (epochs - 1), 1),
                    "reads_follow": sum(r["reads"] for r in plain[1:]),
                    "reads_ahead": sum(r["reads"] for r in ahead[1:]),
                    "held_follow": plain[-1]["held"],
                    "held_ahead": ahead[-1]["held"],
                    "s_follow": round(later_plain, 3),
                    "s_ahead": round(later_ahead, 3),
                    "ahead_over_follow": round(later_ahead / later_plain, 3),
                }
            )
    summary = "; ".join(
        f"{r['load']} loads, mix={r['mix']}: hits {r['hit_pct_follow']} % -> {r['hit_pct_ahead']} %, epochs 1-"
        f"{epochs - 1} {r['s_follow']} s -> {r['s_ahead']} s ({r['ahead_over_follow']}x)"
        for r in rows
    )
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return {
        "title": "Loading the next epoch's arrivals ahead, against a cache that only follows the shard",
        "machine": f"{machine}, torch {torch.__version__}",
        "rows": rows,
        "summary": f"A shard of {n // 4} samples, {epochs} epochs, 4 ms per load, 3 ms of step per batch: {summary}.",
    }


if __name__ == "__main__":
    print_result(run())
