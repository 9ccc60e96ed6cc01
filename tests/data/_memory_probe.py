"""One variant of the cache's memory budget test, in a fresh interpreter: prints the PSS of the main process and of
each DataLoader worker, in KiB, half-way through the second (cached) epoch, as JSON.

Run as ``python -m tests.data._memory_probe {in-memory,cached,leaky} N NUMEL``; ``leaky`` is a cache that keeps 7 KiB
per sample read in each process, the cost the budget is there to catch.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks._node_memory import descendants, pss


class Source(Dataset[tuple[torch.Tensor, int]]):
    """Sample ``i``: ``numel`` float32 values of ``i``, made at each read (nothing held)."""

    def __init__(self, n: int, numel: int) -> None:
        self.n, self.numel = n, numel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((self.numel,), float(i)), i


class Leaky(Dataset[tuple[torch.Tensor, int]]):
    """A ``CachedDataset`` whose every read leaves 7 KiB behind in the reading process."""

    def __init__(self, source: Source) -> None:
        from ignite_ext.data import CachedDataset

        self.cache, self.kept = CachedDataset(source), [bytearray()]

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.kept.append(bytearray(7 << 10))
        sample: tuple[torch.Tensor, int] = self.cache[i]
        return sample


def main(kind: str, n: int, numel: int) -> None:
    source = Source(n, numel)
    dataset: Dataset[Any]
    if kind == "in-memory":
        data = torch.empty(n, numel)  # filled in place: no per-sample objects left on the heap
        for i in range(n):
            data[i] = source[i][0]
        dataset = TensorDataset(data, torch.arange(n))
    else:
        from ignite_ext.data import CachedDataset

        dataset = CachedDataset(source) if kind == "cached" else Leaky(source)
    loader = DataLoader(
        dataset, batch_size=16, shuffle=True, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    batches, seen, found = len(loader), 0, {}
    for epoch in range(2):
        for b, (_, y) in enumerate(loader):
            seen += len(y)
            if epoch == 1 and b == batches // 2:
                workers = descendants(os.getpid())
                found = {"main": pss(os.getpid()) >> 10, "workers": [pss(w) >> 10 for w in workers]}
    assert seen == 2 * n, seen
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
