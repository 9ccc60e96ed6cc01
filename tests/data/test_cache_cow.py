"""Large tensors and arrays come back from the cache as copy-on-write views: no copy, and still safe to modify."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ignite_ext.data import CachedDataset
from ignite_ext.data.cache import _cow as cow
from ignite_ext.data.cache._cow import PAGE, CowMap
from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import LENDABLE

BIG = LENDABLE // 4  # float32 elements of a lendable tensor


def lent(t: torch.Tensor, ds: CachedDataset, tier: str = "ram") -> bool:
    """Whether ``t``'s memory lies in a private (copy-on-write) mapping of the file of ``ds``'s ``tier``."""
    address, wanted = t.data_ptr(), ds.segment if tier == "ram" else ds.disk_segment
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms, *_, path = line.split()
            start, end = (int(a, 16) for a in span.split("-"))
            if path == wanted and "p" in perms and start <= address < end:
                return True
    return False


class BigSamples(Dataset[dict[str, Any]]):
    """Sample ``i``: a lendable float32 tensor and float64 array filled with ``i``, and a small label tensor.

    ``ragged``: sizes differ by sample and are no whole number of pages, so that a sample's large buffers end in
    the middle of a page that also holds the next sample's beginning.
    """

    def __init__(self, ragged: bool = False) -> None:
        self.ragged = ragged

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        extra = 7 * i + 1 if self.ragged else 0
        return {
            "x": torch.full((BIG + extra,), float(i)),
            "a": np.full(BIG // 2 + extra, float(i)),
            "i": torch.tensor(i),
        }


class AugmentInPlace(Dataset[dict[str, Any]]):
    """Modifies every sample it reads in place, as an in-place augmentation would, and reports whether it was lent."""

    def __init__(self, ds: CachedDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.ds[i]
        s["lent"] = lent(s["x"], self.ds) and lent(torch.from_numpy(s["a"]), self.ds)
        s["x"].add_(1000.0)
        s["a"] *= -1.0
        return s


@pytest.fixture
def shm_file() -> Any:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="ignite_ext_test_cow_")
    os.write(fd, bytes(range(256)) * (4 * PAGE // 256))
    yield fd
    os.close(fd)
    os.unlink(path)


def test_a_lent_range_is_private_lent_once_and_clean_when_lent_again(shm_file: int) -> None:
    m = CowMap.open(shm_file)
    assert m is not None
    view = m.lend(PAGE, 2 * PAGE)
    assert view is not None and bytes(view[:4]) == bytes(range(4))
    view[:4] = b"\xff" * 4
    view[PAGE : PAGE + 1] = b"\xff"
    assert os.pread(shm_file, 4, PAGE) == bytes(range(4))  # the file never sees a private write
    assert m.lend(PAGE, 2 * PAGE) is None  # still lent
    other = m.lend(3 * PAGE, PAGE)  # another range is independent
    assert other is not None and bytes(other[:2]) == bytes(range(2))
    del view
    again = m.lend(PAGE, 2 * PAGE)
    assert again is not None and bytes(again[:4]) == bytes(range(4)) and again[PAGE] == 0
    del again, other
    m.close()


def test_unaligned_or_out_of_range_requests_are_not_lent(shm_file: int) -> None:
    m = CowMap.open(shm_file)
    assert m is not None
    assert m.lend(PAGE + 64, PAGE) is None
    assert m.lend(3 * PAGE, 2 * PAGE) is None
    assert m.lend(0, 0) is None
    m.close()


def test_without_page_flags_nothing_is_lent(shm_file: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cow, "_PAGEMAP", "/nonexistent/pagemap")
    assert CowMap.open(shm_file) is None
    ds = CachedDataset(BigSamples(), capacity_bytes=16 << 20)
    ds[1]
    hit = ds[1]
    assert not lent(hit["x"], ds) and hit["x"][0] == 1.0  # copied instead
    hit["x"].add_(1.0)
    assert ds[1]["x"][0] == 1.0
    ds.close()


def test_reservations_put_the_page_offset_on_a_page_boundary() -> None:
    arena = Arena.create(n=3, capacity=1 << 20)
    data_start = arena._mapped().header[6]  # _H_DATA: a page boundary of the file
    first = arena.reserve(0, 100)
    second = arena.reserve(1, PAGE + 1, page_offset=128)
    third = arena.reserve(2, 100)
    assert first == 0 and second is not None and third is not None
    assert data_start % PAGE == 0 and (data_start + second + 128) % PAGE == 0 and second >= 128
    assert third == second + PAGE + 64  # packed after it, 64-byte aligned: no padding to a page
    arena.close()


def test_large_samples_are_lent_and_two_live_reads_are_independent() -> None:
    ds = CachedDataset(BigSamples(), capacity_bytes=16 << 20)
    ds[3]
    a, b = ds[3], ds[3]
    assert lent(a["x"], ds) and not lent(b["x"], ds)  # a second live read of the same sample gets a copy
    assert lent(torch.from_numpy(a["a"]), ds) and a["a"].flags.writeable
    assert not lent(a["i"], ds)  # small tensors are always copied
    a["x"].fill_(7.0)
    a["a"][:] = 7.0
    assert b["x"][0] == 3.0 and b["a"][0] == 3.0
    c = ds[3]
    assert c["x"].eq(3.0).all() and (c["a"] == 3.0).all()
    del a, c
    d = ds[3]  # lent again: the pages written through `a` were dropped
    assert lent(d["x"], ds) and d["x"].eq(3.0).all() and (d["a"] == 3.0).all()
    assert ds.stats().hits == 4
    ds.close()


@pytest.mark.distributed
@pytest.mark.parametrize(("context", "ragged"), [("fork", False), ("spawn", False), ("fork", True)])
def test_in_place_augmentation_in_workers_never_reaches_later_epochs(context: str, ragged: bool) -> None:
    ds = CachedDataset(BigSamples(ragged), capacity_bytes=16 << 20)
    dl = DataLoader(
        AugmentInPlace(ds),
        batch_size=None if ragged else 3,  # ragged samples do not stack
        shuffle=True,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=True,  # the same processes read every index again, after having modified it
    )
    for e in range(3):
        seen = []
        for batch in dl:
            samples = [batch] if ragged else [{k: v[j] for k, v in batch.items()} for j in range(len(batch["i"]))]
            for s in samples:
                i = float(s["i"])
                assert s["x"].eq(i + 1000.0).all() and (torch.as_tensor(s["a"]) == -i).all()
                assert bool(s["lent"]) == (e > 0)  # epoch 0 loads: the originals
                seen.append(int(s["i"]))
        assert sorted(seen) == list(range(len(ds)))
    assert ds.stats().hits == 2 * len(ds)
    del dl
    ds.close()


@pytest.mark.distributed
def test_lent_tensors_cross_to_the_main_process_intact() -> None:
    ds = CachedDataset(BigSamples(), capacity_bytes=16 << 20)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", persistent_workers=True)
    for _ in range(3):
        for s in dl:  # unbatched: each sample is sent to this process as it is
            i = float(s["i"])
            assert s["x"].eq(i).all() and (s["a"] == i).all()
            s["x"].zero_()
    assert ds.stats().hits == 2 * len(ds)
    del dl
    ds.close()


def test_threads_reading_one_large_sample_never_share_its_memory() -> None:
    ds = CachedDataset(BigSamples(), capacity_bytes=16 << 20)
    ds[5]
    errors: list[str] = []

    def reader(tid: int) -> None:
        for _ in range(200):
            x = ds[5]["x"]
            if not x.eq(5.0).all():
                errors.append(f"thread {tid} read a modified sample")
            x.fill_(-float(tid))
            time.sleep(0)  # let another thread read (and, if it were lent the same pages, write) meanwhile
            if not x.eq(-float(tid)).all():
                errors.append(f"thread {tid} shares its sample's memory with another thread")

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert ds.stats().hits == 800
    ds.close()
