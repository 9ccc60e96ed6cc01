"""``CachedDataset.__getitems__``, what a DataLoader calls per batch, reads exactly what ``ds[i]`` reads, one by one.

Hits, misses, both tiers, negative indices, the transform, the counters, and an index out of range (which raises,
with the hits before it counted).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ignite_ext.data import CachedDataset


def _samples() -> list[tuple[torch.Tensor, np.ndarray, int]]:
    # 64 KiB and 256 KiB tensors: below and above the size that is lent rather than copied.
    return [(torch.full((16384 * (1 + 3 * (i % 2)),), float(i)), np.arange(3) + i, i) for i in range(6)]


def _equal(a: tuple[torch.Tensor, np.ndarray, int], b: tuple[torch.Tensor, np.ndarray, int]) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_a_batch_reads_what_single_reads_read(tmp_path: object) -> None:
    source = _samples()
    one = 16384 * 4 + 4096
    # RAM for two samples, disk for the rest: a batch mixes RAM hits, disk hits and misses.
    ds = CachedDataset(source, capacity_bytes=2 * one, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    first = ds.__getitems__([0, 2, 1, 0, -1])  # misses, then a RAM hit of 0; -1 is 5
    assert [s[2] for s in first] == [0, 2, 1, 0, 5]
    assert all(_equal(s, source[s[2]]) for s in first)
    stats = ds.stats()
    assert (stats.hits, stats.misses) == (1, 4)
    again = ds.__getitems__(list(range(6)))
    assert all(_equal(s, source[i]) for i, s in enumerate(again))
    stats = ds.stats()
    assert (stats.hits, stats.misses) == (1 + 4, 4 + 2) and stats.disk_hits > 0  # 3 and 4 were never read
    # Each sample of a batch is its own: writing into one changes neither the cache nor another read.
    batch = ds.__getitems__([1, 1])
    batch[0][0].fill_(-1.0)
    batch[0][1][:] = -1
    assert _equal(batch[1], source[1]) and _equal(ds[1], source[1])
    with pytest.raises(IndexError, match="index 6 out of range"):
        ds.__getitems__([0, 6])
    assert ds.stats().hits == stats.hits + 2 + 1 + 1  # the batch of [1, 1], ds[1], and 0 before the bad index
    ds.close()


def test_a_batch_applies_the_transform_to_each_sample() -> None:
    ds = CachedDataset(_samples(), capacity_bytes=1 << 24, transform=lambda s: s[2] * 10)
    assert ds.__getitems__([3, 4, 3]) == [30, 40, 30]
    assert ds.stats().hits == 1
    ds.close()


def test_a_dataloader_reads_batches_through_it() -> None:
    source = _samples()
    ds = CachedDataset(source, capacity_bytes=1 << 24)
    calls: list[list[int]] = []
    original = ds.__getitems__

    def spy(indices: list[int]) -> list[object]:
        calls.append(list(indices))
        return original(indices)

    ds.__getitems__ = spy  # type: ignore[method-assign]
    loader = DataLoader(ds, batch_size=2, collate_fn=list)
    for _ in range(2):
        assert [s[2] for batch in loader for s in batch] == list(range(6))
    assert calls == [[0, 1], [2, 3], [4, 5]] * 2
    assert (ds.stats().hits, ds.stats().misses) == (6, 6)
    ds.close()
