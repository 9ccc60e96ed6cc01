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

``python -m tests.data._memory_probe collect {parent,child,none}`` forces a full collection in the main process and
in each of its 2 persistent workers between two cached epochs, and prints what each process's private dirty memory
grew across its own collection (KiB), and how many objects the main process froze. The main process holds 100,000
small dicts and lists besides torch's heap, and collects only when told (``gc.disable()``): no collection of its own
comes first by chance. ``parent``: the package's default (the rank freezes before it forks). ``child``: the rank
opted out, its workers still freeze at their first read (0.5.0). ``none``: neither freezes.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from benchmarks._node_memory import data_memory, descendants, private_dirty, pss


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


_collect_now = mp.RawValue("b", 0)  # in shared memory: the main process tells its forked workers to collect


def _collect_when_told(batch: list[dict[str, Any]]) -> Any:
    """Collate; at the first batch after the main process said so, a worker collects and adds its growth (KiB)."""
    grew = (0, 0)
    if _collect_now.value and os.getpid() not in _collected:
        _collected.add(os.getpid())
        before = private_dirty(os.getpid())
        gc.collect()
        grew = (os.getpid(), (private_dirty(os.getpid()) - before) >> 10)
    return {**default_collate(batch), "grew": grew}


def collections(variant: str) -> None:
    """Force a full collection in the main process, then in each worker, between two cached epochs (see above)."""
    gc.disable()
    from ignite_ext.data import CachedDataset
    from ignite_ext.data.cache import dataset
    from ignite_ext.data.fork_memory import freeze_before_forks

    freeze_before_forks(variant == "parent")
    if variant == "none":
        dataset.share_inherited_heap = lambda: None  # type: ignore[attr-defined]
    kept = [{"i": i, "seen": []} for i in range(100_000)]  # many small tracked objects, as a training script holds
    items = [{"x": torch.full((1024,), float(i)), "y": i} for i in range(128)]
    cache = CachedDataset(items, capacity_bytes=1 << 20)
    loader = DataLoader(
        cache,
        batch_size=8,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
        collate_fn=_collect_when_told,
    )
    epochs = [sum(len(b["y"]) for b in loader) for _ in range(2)]  # the workers fork and fill the cache, then hits
    before = private_dirty(os.getpid())
    gc.collect()
    rank = (private_dirty(os.getpid()) - before) >> 10
    _collect_now.value = 1
    workers = {}
    for b in loader:
        pid, grew = b["grew"]
        if pid:
            workers[int(pid)] = int(grew)
    assert epochs == [128, 128] and len(workers) == 2, (epochs, workers)
    found = {"rank": rank, "workers": sorted(workers.values()), "frozen": gc.get_freeze_count(), "kept": len(kept)}
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collections(sys.argv[2])
    else:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
