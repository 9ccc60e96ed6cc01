"""The default cache name: the same in every process, different for training and validation sets, O(1) to make."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import ConcatDataset, Subset, TensorDataset

from ignite_ext.data import CachedDataset
from ignite_ext.data.cache.identity import default_name, describe
from tests.data.test_cache import CountingDataset

ROOT = Path(__file__).resolve().parents[2]


class Folder:
    """A stand-in of an image folder: a root, a split flag, a sample list, a transform and private bookkeeping."""

    def __init__(self, root: str, train: bool = True, n: int = 50) -> None:
        self.root, self.train = root, train
        self.samples = [(Path(root) / f"{i:05d}.png", i % 10) for i in range(n)]
        self.transform = lambda image: image  # an object: only its type counts
        self._opened: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        raise AssertionError("making a name must not read a sample")


def test_training_and_validation_sets_get_different_names() -> None:
    train, val = Folder("/data/train"), Folder("/data/val")
    assert default_name(train) != default_name(val)
    assert default_name(Folder("/data", train=True)) != default_name(Folder("/data", train=False))
    assert default_name(train) == default_name(Folder("/data/train"))  # equal datasets, equal names
    assert default_name(train).startswith(f"{__name__}.Folder[50]#")
    # The middle of a list does not count (that keeps it O(1)); its length and ends do.
    shifted = Folder("/data/train")
    shifted.samples[1:-1] = list(reversed(shifted.samples[1:-1]))
    assert default_name(shifted) == default_name(train)
    shifted.samples[-1] = (Path("/data/train/other.png"), 3)
    assert default_name(shifted) != default_name(train)


def test_wrapped_datasets_are_told_apart_by_what_they_wrap() -> None:
    base = list(range(100))
    assert default_name(Subset(base, range(0, 50))) != default_name(Subset(base, range(50, 100)))
    assert default_name(Subset(base, [0, 1, 2])) != default_name(Subset(base, [0, 1, 3]))
    a, b = Folder("/data/a", n=10), Folder("/data/b", n=10)
    assert default_name(ConcatDataset([a, b])) != default_name(ConcatDataset([b, a]))
    # Tensors count by dtype and shape, never by their values (which could be large).
    assert "float32, (3, 4)" in describe(TensorDataset(torch.zeros(3, 4)))
    assert default_name(TensorDataset(torch.zeros(3, 4))) == default_name(TensorDataset(torch.ones(3, 4)))


def test_a_name_reads_no_sample_and_ignores_private_state() -> None:
    ds = Folder("/data/train")
    before = default_name(ds)
    ds._opened[3] = object()
    assert default_name(ds) == before
    counting = CountingDataset(8)
    default_name(counting)
    assert counting.loads() == [0] * 8
    huge = Folder("/data/train")
    huge.root = "x" * 10_000_000  # long strings: their length and ends only
    assert len(describe(huge)) < 10_000


@pytest.mark.distributed  # two helper processes
def test_the_default_name_is_the_same_in_every_process() -> None:
    code = textwrap.dedent(
        """
        from tests.data.test_cache_names import Folder
        from ignite_ext.data.cache.identity import default_name
        print(default_name(Folder("/data/train")))
        """
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},  # str hashes differ between these processes
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert names == {default_name(Folder("/data/train"))}


def test_a_cache_has_the_name_given_or_the_default() -> None:
    data = [torch.zeros(2)] * 4
    ds = CachedDataset(data, capacity_bytes=1 << 20)
    assert ds.name == default_name(data) and ds.name.startswith("builtins.list[4]#")
    ds.close()
    named = CachedDataset(data, capacity_bytes=1 << 20, name="zeros")
    assert named.name == "zeros"
    named.close()
    for bad in ("", 3):
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            CachedDataset(data, capacity_bytes=1 << 20, name=bad)  # type: ignore[arg-type]
