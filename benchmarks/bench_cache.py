"""Cached epoch throughput of CachedDataset against a Manager-dict cache, no cache, and an in-memory dataset.

Every variant runs through the same DataLoader (4 workers, fork, persistent, batches of 16, shuffled) over samples of
64 KiB and 1 MiB (float32 tensors), the variants taking turns epoch by epoch. From epoch 2 on, when every cache is
warm, it reports each variant's best samples/s and, as ratios, the median over those epochs of its rate over the
peer's rate in the same round. The variants:

* ``in-memory``: a ``TensorDataset`` over one tensor holding everything: the limit, no loading at all;
* ``CachedDataset``: the shared-memory cache wrapping the disk dataset;
* ``Manager dict``: a ``multiprocessing.Manager().dict()`` cache shared by the workers, as VisCy's cached dataset
  keeps it (checked with ``in`` and read with ``[]``: two round trips to the manager process per hit, the tensor
  travelling as a shared-memory file descriptor each time);
* ``no cache``: the disk dataset itself: reads one file per sample and pays a simulated 2 ms decode.

It also reports the node memory of the cache (the PSS of its segment summed over the main process and the
workers, against the bytes cached) and what one hit costs: as the cache serves it (buffers of 64 KiB and more lent
as copy-on-write views, smaller ones copied) and when every buffer is copied.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import tempfile
import time
import warnings
from multiprocessing.managers import SyncManager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ignite_ext.data import CachedDataset
from ignite_ext.data.cache.codec import decode
from ignite_ext.data.cache.shm import mapped_pss

NAME = "cache"

WORKERS = 4
BATCH = 16
DECODE_S = 0.002  # what decoding a compressed sample of this size would take


class DiskDataset(Dataset[tuple[torch.Tensor]]):
    """One ``.npy``-like raw file per sample; each read opens it and pays a fixed decode time."""

    def __init__(self, root: str, n: int) -> None:
        self.root, self.n = root, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        x = np.fromfile(os.path.join(self.root, f"{i}.f32"), dtype=np.float32)
        time.sleep(DECODE_S)
        return (torch.from_numpy(x),)


class ManagerDictCache(Dataset[tuple[torch.Tensor]]):
    """A cache in a ``Manager().dict()`` shared by all workers, keyed by index."""

    def __init__(self, dataset: DiskDataset, cache: Any) -> None:
        self.dataset, self.cache = dataset, cache

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        if i not in self.cache:
            self.cache[i] = self.dataset[i][0]
        return (self.cache[i],)


def _loader(dataset: Dataset[Any]) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        multiprocessing_context="fork",
        persistent_workers=True,
    )


def _rates(loaders: dict[str, DataLoader[Any]], epochs: int) -> dict[str, list[float]]:
    """Samples/s of each loader in each epoch from 2 on; the loaders take turns, epoch by epoch."""
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for e in range(epochs):
        for name, loader in loaders.items():
            start = time.perf_counter()
            count = sum(len(batch[0]) for batch in loader)
            if e >= 2:
                rates[name].append(count / (time.perf_counter() - start))
    return rates


def _paired(rates: dict[str, list[float]], variant: str, peer: str) -> float:
    """Median over epochs of ``variant``'s rate over ``peer``'s in the same round.

    Each ratio compares runs a few seconds apart, so the machine's load drifts cancel out; a ratio of bests would
    favour whichever variant got the quietest moment.
    """
    return statistics.median(a / b for a, b in zip(rates[variant], rates[peer], strict=True))


def _hit_cost(ds: CachedDataset) -> tuple[float, float]:
    """Microseconds per hit as the cache decodes it, and with every buffer copied; pages already mapped."""
    arena = ds._arena
    times = []
    for lend in (True, False):
        for _ in range(2):  # the second pass, once this process has mapped every page
            start = time.perf_counter()
            for i in range(len(ds)):
                raw = arena.lookup(i)
                assert raw is not None
                decode(raw, functools.partial(arena.borrow, i) if lend else None)  # dropped: lendable again
            elapsed = time.perf_counter() - start
        times.append(elapsed / len(ds) * 1e6)
    return times[0], times[1]


def _one_size(sample_bytes: int, n: int, epochs: int, manager: SyncManager, root: str) -> list[dict[str, Any]]:
    numel = sample_bytes // 4
    data = torch.randn(n, numel)
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        data[i].numpy().tofile(os.path.join(root, f"{i}.f32"))
    disk = DiskDataset(root, n)
    cached = CachedDataset(disk, capacity_bytes=n * (sample_bytes + 4096))
    loaders = {
        "in-memory": _loader(TensorDataset(data)),
        "CachedDataset": _loader(cached),
        "Manager dict": _loader(ManagerDictCache(disk, manager.dict())),
        "no cache": _loader(disk),
    }
    per_epoch = _rates(loaders, epochs)
    rates = {name: max(r) for name, r in per_epoch.items()}
    workers = [w.pid for w in loaders["CachedDataset"]._iterator._workers]  # type: ignore[union-attr]
    pss = mapped_pss(cached.segment, [os.getpid(), *workers])
    del loaders
    hit_us, copy_us = _hit_cost(cached)
    stats = cached.stats()
    cached.close()
    label = f"{sample_bytes // 1024} KiB" if sample_bytes < 1 << 20 else f"{sample_bytes >> 20} MiB"
    rows = []
    for variant, rate in rates.items():
        rows.append(
            {
                "label": f"{label} {variant}",
                "sample": label,
                "variant": variant,
                "samples_per_s": round(rate, 1),
                "MiB_per_s": round(rate * sample_bytes / 2**20, 1),
                "vs_in_memory": round(_paired(per_epoch, variant, "in-memory"), 3),
                "vs_manager_dict": round(_paired(per_epoch, variant, "Manager dict"), 3),
                "cache_pss_over_bytes": round(pss / stats.bytes, 3) if variant == "CachedDataset" else "",
                "hit_us": round(hit_us, 1) if variant == "CachedDataset" else "",
                "hit_if_copied_us": round(copy_us, 1) if variant == "CachedDataset" else "",
                "hit_rate_epochs_ge_1": round(stats.hits / (stats.hits + stats.misses - n), 3)
                if variant == "CachedDataset"
                else "",
            }
        )
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    """Run both sample sizes; ``quick`` uses fewer samples and epochs (about half a minute)."""
    sizes = [(64 << 10, 256 if quick else 4096), (1 << 20, 64 if quick else 256)]
    epochs = 5 if quick else 10
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench_cache_") as tmp,
        SyncManager() as manager,
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on fewer cores
        for sample_bytes, n in sizes:
            rows += _one_size(sample_bytes, n, epochs, manager, os.path.join(tmp, str(sample_bytes)))
    parts = []
    for label in dict.fromkeys(r["sample"] for r in rows):
        by = {r["variant"]: r for r in rows if r["sample"] == label}
        ours = by["CachedDataset"]
        parts.append(
            f"{label}: CachedDataset {ours['vs_in_memory']:.2f}x the in-memory limit, "
            f"{ours['vs_manager_dict']:.1f}x the Manager dict, "
            f"{ours['samples_per_s'] / by['no cache']['samples_per_s']:.1f}x no cache; "
            f"cache PSS {ours['cache_pss_over_bytes']:.2f}x the bytes cached; "
            f"a hit costs {ours['hit_us']:.0f} us ({ours['hit_if_copied_us']:.0f} us if it copied every buffer)"
        )
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return {
        "title": "Cached epoch throughput (epochs >= 2): CachedDataset vs Manager dict, no cache, in-memory",
        "machine": f"{machine}, torch {torch.__version__}, {WORKERS} workers, batch {BATCH}",
        "rows": rows,
        "summary": ". ".join(parts) + ".",
        "plot": {"x": "label", "y": ["vs_in_memory"], "kind": "bar"},
    }


def _print(result: dict[str, Any]) -> None:
    rows = result["rows"]
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print(result["title"], result["machine"], sep="\n")
    print(" | ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print(" | ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths, strict=True)))
    print(result["summary"])


if __name__ == "__main__":
    import sys

    _print(run(quick="--quick" in sys.argv[1:]))
