"""One variant of the cache's memory budget test, in a fresh interpreter, in the setup of a reported 1.34x.

Samples are ``{"x": tensor, "y": i}`` read with ``numpy.load`` from one ``.npy`` file each; a DataLoader with 2 fork
workers (persistent), batches of 16, shuffled; the workers fill the cache in the first epoch, then two cached
epochs, and half-way through a third the PSS and the private dirty memory (anonymous and ``[heap]``) of the main
process and of each worker are printed, in KiB, as JSON. Every worker runs one full garbage collection at its first
batch: what a worker that allocates objects per sample reaches by itself within an epoch, here at a known moment, so
that the measure does not depend on where each variant's collector counts stood at the fork. The in-memory
baseline's workers call ``gc.freeze()`` first (its best: otherwise that collection copies the rank's heap into each
of them).

Run as ``python -m tests.data._memory_probe {in-memory,cached,leaky} N NUMEL DIR``; ``leaky`` is a cache that keeps
7 KiB per sample read in each process, the cost the budget is there to catch.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from benchmarks._node_memory import data_memory, descendants, pss


class Npy(Dataset[dict[str, Any]]):
    """Sample ``i``: ``{"x": the float32 array in DIR/i.npy, "y": i}``, read at each access (nothing held)."""

    def __init__(self, root: str, n: int) -> None:
        self.root, self.n = root, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.from_numpy(np.load(f"{self.root}/{i}.npy")), "y": i}


class InMemory(Dataset[dict[str, Any]]):
    """The baseline: one preallocated tensor of every sample, filled in place (no per-sample object left)."""

    def __init__(self, source: Npy) -> None:
        self.data = torch.empty(len(source), *source[0]["x"].shape)
        for i in range(len(source)):
            self.data[i] = source[i]["x"]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.data[i], "y": i}


class Leaky(Dataset[dict[str, Any]]):
    """A ``CachedDataset`` whose every read leaves 7 KiB behind in the reading process."""

    def __init__(self, source: Npy) -> None:
        from ignite_ext.data import CachedDataset

        self.cache, self.kept = CachedDataset(source), [bytearray()]

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.kept.append(bytearray(7 << 10))
        sample: dict[str, Any] = self.cache[i]
        return sample


_collected: set[int] = set()


def _collate(batch: list[dict[str, Any]]) -> Any:
    if get_worker_info() is not None and os.getpid() not in _collected:  # once per worker process
        _collected.add(os.getpid())
        gc.collect()
    return default_collate(batch)


def _freeze(worker_id: int) -> None:
    """The in-memory baseline at its best: its workers keep the rank's heap shared (CPython's advice for forks)."""
    gc.freeze()


def main(kind: str, n: int, numel: int, root: str) -> None:
    if not os.path.exists(f"{root}/{n - 1}.npy"):
        rng = np.random.default_rng(0)
        for i in range(n):
            np.save(f"{root}/{i}.npy", rng.random(numel, dtype=np.float32))
    source = Npy(root, n)
    dataset: Dataset[Any]
    if kind == "in-memory":
        dataset = InMemory(source)
    else:
        from ignite_ext.data import CachedDataset

        capacity = n * (numel * 4 + 4096)
        dataset = CachedDataset(source, scope="rank", capacity_bytes=capacity) if kind == "cached" else Leaky(source)
    loader = DataLoader(
        dataset,
        batch_size=16,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
        collate_fn=_collate,
        worker_init_fn=_freeze if kind == "in-memory" else None,
    )
    batches, seen, found = len(loader), 0, {}
    for epoch in range(4):
        for b, batch in enumerate(loader):
            seen += len(batch["y"])
            if epoch == 3 and b == batches // 2:
                pids = [os.getpid(), *descendants(os.getpid())]
                data = [data_memory(p) for p in pids]
                found = {
                    "main": pss(pids[0]) >> 10,
                    "workers": [pss(w) >> 10 for w in pids[1:]],
                    "data": [d["pss"] >> 10 for d in data],
                    "private_dirty": [d["private_dirty"] >> 10 for d in data],
                }
    assert seen == 4 * n, seen
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
