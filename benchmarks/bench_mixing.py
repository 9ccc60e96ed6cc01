"""Shards that mix, on a real task: accuracy, cache hits, storage reads and epoch time, side by side in one run.

The same small model (an MLP with batch normalisation, as most vision models have) is trained with DDP on 4 gloo
ranks, with torch's ``DistributedSampler``, fixed shards (``ShardedDistributedSampler``, ``mix=0``) and shards
that mix (``mix=0.05`` and ``0.25``), each rank reading through its own ``CachedDataset``. The dataset is written
sorted by class, as real shards are, so fixed shards give each rank two or three classes for ever: its batch
statistics are those of its classes, and the running statistics DDP keeps are rank 0's. Per epoch: validation
accuracy (a balanced held-out set), training loss, the ranks' cache hit rate, storage reads (cache misses), the
cache's entries per rank (what it holds) and the epoch's time.

With ``mix > 0`` the cache follows the shard (``CachedDataset.follow``, called by the sampler each epoch): it evicts
what left and stores what arrived in the space it held, so the entries it holds per rank stay one shard and the
RAM it uses stays what the first epoch took (both columns); fixed shards and torch's sampler evict nothing.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from benchmarks._report import print_result
from ignite_ext.data import CachedDataset, ShardedDistributedSampler

NAME = "mixing"

RANKS = 4
CLASSES = 10
FEATURES = 32
BATCH = 32
VARIANTS = ("torch", "fixed", "mix=0.05", "mix=0.25")


class SortedBlobs(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples of ``CLASSES`` Gaussian classes in ``FEATURES`` dimensions, sorted by class (index // (n/C))."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234)) * 1.5
        labels = torch.arange(n) * CLASSES // n
        self.x = centres[labels] + torch.randn(n, FEATURES, generator=generator) * 2.0
        self.y = labels

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], int(self.y[index])


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, CLASSES),
    )  # fmt: skip


def _rank(rank: int, variant: str, n: int, epochs: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.manual_seed(0)
    train = CachedDataset(SortedBlobs(n, seed=0), name=f"bench-mixing-{variant}-{rank}")
    sampler: DistributedSampler[Any]
    if variant == "torch":
        sampler = DistributedSampler(train, num_replicas=RANKS, rank=rank, seed=0)  # type: ignore[arg-type]
    else:
        mix = 0.0 if variant == "fixed" else float(variant.split("=")[1])
        sampler = ShardedDistributedSampler(train, num_replicas=RANKS, rank=rank, seed=0, mix=mix)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
    val = SortedBlobs(n // 4, seed=1)
    model = nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    seen = (0, 0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        start, total, batches = time.perf_counter(), 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        seconds = time.perf_counter() - start
        stats = train.stats()
        hits, misses = stats.hits - seen[0], stats.misses - seen[1]
        seen = (stats.hits, stats.misses)
        model.eval()
        with torch.no_grad():
            accuracy = float((model(val.x).argmax(1) == val.y).float().mean())
        held = stats.entries - stats.evictions
        counts = torch.tensor([hits, misses, held, seconds * 1e6, train.used_bytes], dtype=torch.float64)
        dist.all_reduce(counts)
        rows.append(
            {
                "epoch": epoch,
                "accuracy": accuracy,
                "loss": total / max(batches, 1),
                "hit_rate": float(counts[0] / max(float(counts[0] + counts[1]), 1.0)),
                "storage_reads": int(counts[1]),
                "entries_per_rank": int(counts[2]) // RANKS,
                "seconds": float(counts[3]) / 1e6 / RANKS,
                "used_kib_per_rank": int(counts[4]) // RANKS // 1024,
            }
        )
    if rank == 0:
        torch.save(rows, out)
    train.close()
    # DDP's reducer, freed after the group is destroyed, would free the group itself while holding the GIL, and
    # gloo's worker thread, freeing its last tensors, waits for the GIL: a deadlock in torch at exit.
    del model, optimizer
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(quick: bool = False) -> dict[str, Any]:
    n, epochs = (2_000, 6) if quick else (8_000, 16)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:  # one after another, in one run: the same machine state for each
            out = str(Path(tmp, f"{variant}.pt"))
            mp.start_processes(_rank, args=(variant, n, epochs, _free_port(), out), nprocs=RANKS, start_method="fork")
            results[variant] = torch.load(out)
    rows = []
    for epoch in range(epochs):
        row: dict[str, Any] = {"epoch": epoch}
        for variant in VARIANTS:
            r = results[variant][epoch]
            key = variant.replace("=", "").replace(".", "")
            row[f"{key}_acc"] = round(100 * r["accuracy"], 1)
            row[f"{key}_hit_pct"] = round(100 * r["hit_rate"], 1)
            row[f"{key}_reads"] = r["storage_reads"]
            row[f"{key}_entries"] = r["entries_per_rank"]
            row[f"{key}_kib"] = r["used_kib_per_rank"]
            row[f"{key}_s"] = round(r["seconds"], 3)
        rows.append(row)
    last = rows[-1]
    summary = (
        f"N={n} sorted by class ({CLASSES} classes), {RANKS} gloo ranks, {epochs} epochs, MLP with BatchNorm. "
        f"Validation accuracy after the last epoch: torch {last['torch_acc']} %, fixed shards {last['fixed_acc']} %, "
        f"mix=0.05 {last['mix005_acc']} %, mix=0.25 {last['mix025_acc']} %. Cache hit rate in the last epoch: "
        f"torch {last['torch_hit_pct']} %, fixed {last['fixed_hit_pct']} %, mix=0.05 {last['mix005_hit_pct']} %, "
        f"mix=0.25 {last['mix025_hit_pct']} %; entries held per rank: torch {last['torch_entries']}, "
        f"fixed {last['fixed_entries']}, mix=0.05 {last['mix005_entries']}, mix=0.25 {last['mix025_entries']} "
        f"(a shard is {n // RANKS}; the mixing caches follow their shards), RAM used per rank (KiB): torch "
        f"{last['torch_kib']}, fixed {last['fixed_kib']}, mix=0.05 {last['mix005_kib']}, mix=0.25 "
        f"{last['mix025_kib']} (first epoch: {rows[0]['mix025_kib']})."
    )
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return {
        "title": "Shards that mix: accuracy and cache hits against fixed shards and torch's DistributedSampler",
        "machine": f"{machine}, torch {torch.__version__}",
        "rows": rows,
        "summary": summary,
        "plot": {"x": "epoch", "y": ["torch_acc", "fixed_acc", "mix005_acc", "mix025_acc"], "kind": "line"},
    }


if __name__ == "__main__":
    print_result(run())
