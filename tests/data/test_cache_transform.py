"""Augmentations after the cache: ``transform=`` runs in the DataLoader worker on every read; frozen ones warn.

Also: a worker that unpickles the cache (what ``spawn`` workers do) imports neither ignite nor
``ignite_ext.distributed``, so it does not pay for the parent's imports.
"""

from __future__ import annotations

import operator
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset

from ignite_ext.data import CachedDataset
from ignite_ext.data.cache import FrozenTransformWarning
from ignite_ext.data.cache.codec import decode
from tests.data.test_cache import CountingDataset, epoch, loader

ROOT = Path(__file__).resolve().parents[2]
N = 16


def jitter(sample: dict[str, Any]) -> dict[str, Any]:
    """A random augmentation (noise drawn from torch's RNG), which also says in which process it ran."""
    return {**sample, "noise": torch.rand(()), "pid": os.getpid(), "x": sample["x"] + 0}


def noise_by_index(dl: DataLoader[Any], pids: set[int]) -> dict[int, float]:
    seen = {}
    for batch in dl:
        pids.update(batch["pid"].tolist())
        seen.update(zip(batch["i"].tolist(), batch["noise"].tolist(), strict=True))
    return seen


@pytest.mark.distributed
@pytest.mark.parametrize("persistent", [True, False])
def test_a_random_transform_is_drawn_anew_every_epoch_in_the_workers(persistent: bool) -> None:
    base = CountingDataset(N)
    ds = CachedDataset(base, capacity_bytes=1 << 20, transform=jitter)
    dl = loader(ds, persistent_workers=persistent)
    assert sorted(epoch(dl)) == list(range(N))  # the samples themselves are intact
    pids: set[int] = set()
    epochs = [noise_by_index(dl, pids) for _ in range(3)]
    assert all(sorted(e) == list(range(N)) for e in epochs)
    for i in range(N):  # every epoch drew its own noise for every sample
        assert len({e[i] for e in epochs}) == 3, [e[i] for e in epochs]
    assert base.loads() == [1] * N  # while each sample was loaded once
    assert os.getpid() not in pids and len(pids) >= 2  # in the workers
    cached = decode(ds._tiers.ram.lookup(0), lambda start, nbytes: None)  # type: ignore[arg-type]
    assert "noise" not in cached and cached["i"] == 0  # the cache holds the untransformed sample
    st = ds.stats()
    assert (st.misses, st.hits) == (N, 3 * N)
    ds.close()


def scale_in_place(sample: dict[str, Any]) -> dict[str, Any]:
    sample["x"].mul_(-1)
    return sample


def test_a_transform_that_modifies_the_sample_in_place_cannot_reach_the_cache() -> None:
    ds = CachedDataset(CountingDataset(4), capacity_bytes=1 << 20, transform=scale_in_place)
    assert ds[2]["x"][0] == -2.0  # the miss: transformed after it was stored
    assert ds[2]["x"][0] == -2.0  # the hit: transformed again, from the stored +2
    ds.close()
    with pytest.raises(TypeError, match="callable"):
        CachedDataset([1], capacity_bytes=1 << 20, transform="flip")  # type: ignore[arg-type]


class VisionLike:
    """What torchvision's datasets do: ``transform`` applied inside ``__getitem__``."""

    def __init__(self, transform: Any = None) -> None:
        self.transform, self.target_transform = transform, None
        self.transforms = None if transform is None else ("standard", transform)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        image = torch.full((2,), float(i))
        return image if self.transform is None else self.transform(image)


def random_shift(image: torch.Tensor) -> torch.Tensor:
    return image + torch.rand(())


def test_a_dataset_that_transforms_inside_getitem_warns_once_and_is_frozen() -> None:
    frozen = VisionLike(transform=random_shift)
    with pytest.warns(FrozenTransformWarning) as caught:
        ds = CachedDataset(frozen, capacity_bytes=1 << 20)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "VisionLike applies its transform=<function random_shift" in text
    assert "CachedDataset(dataset, transform=...)" in text and "filterwarnings" in text
    assert caught[0].filename == __file__  # points at the construction
    assert torch.equal(ds[1], ds[1])  # what it warns about: the first draw, served again
    ds.close()
    for wrapped in (Subset(frozen, [0, 1]), ConcatDataset([VisionLike(), frozen])):
        with pytest.warns(FrozenTransformWarning, match="VisionLike applies its transform="):
            CachedDataset(wrapped, capacity_bytes=1 << 20).close()
    # The pattern it recommends: the dataset plain, the augmentation after the cache; no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = CachedDataset(VisionLike(), capacity_bytes=1 << 20, transform=random_shift)
    assert not torch.equal(fixed[1], fixed[1])
    assert fixed.stats().hits == 1
    fixed.close()


@pytest.mark.distributed  # a helper process
def test_a_process_that_unpickles_the_cache_imports_neither_ignite_nor_the_scheduler() -> None:
    # Its dataset and transform import nothing themselves (this module would: it imports ignite's Engine).
    ds = CachedDataset([torch.full((2,), float(i)) for i in range(4)], capacity_bytes=1 << 20, transform=operator.neg)
    ds[1]
    code = textwrap.dedent(
        """
        import pickle, sys
        ds = pickle.loads(sys.stdin.buffer.read())  # what a spawned DataLoader worker does first
        assert ds[1][0] == -1.0 and ds[2][0] == -2.0
        print(sorted(m for m in sys.modules if m.split(".")[0] == "ignite" or m.startswith("ignite_ext.distributed")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, input=pickle.dumps(ds), capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().strip() == "[]"
    assert ds.stats().hits == 1 and ds.stats().misses == 2  # the helper counted in this rank's cache
    ds.close()
