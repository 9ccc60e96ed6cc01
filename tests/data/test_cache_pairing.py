"""Node caches pair by what two different datasets cannot share: where each was constructed, and sampled content.

The ranks of a node pair their node caches by the order of construction. Two datasets that look alike to the
default name (same type, length and public attributes: two lists of 4 tensors) built in different orders on two
ranks must raise on every rank, never pair: neither by default nor under one explicit ``name=``.
"""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import ignite.distributed as idist
import numpy as np
import pytest
import torch

from ignite_ext.data import CachedDataset
from tests._world import World

CAP = 1 << 20


def _splits(n: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two look-alike datasets: training samples all 1s, validation samples all -1s."""
    return [torch.ones(3) for _ in range(n)], [-torch.ones(3) for _ in range(n)]


def _outcome(build: Any) -> dict[str, Any]:
    """Build the caches; on success, read them the way that shows a mix-up: rank 0 fills train, then all read val."""
    try:
        train, val = build()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    if idist.get_rank() == 0:
        [train[i] for i in range(len(train))]  # stores training samples (1s)
    idist.barrier()
    seen = [float(val[i][0]) for i in range(len(val))]  # -1.0 each, unless val is paired with train's cache
    idist.barrier()
    train.close()
    val.close()
    return {"val": seen}


def _orders(lines: str) -> dict[str, Any]:
    data = _splits()

    def build() -> tuple[CachedDataset, CachedDataset]:
        first = 1 if idist.get_rank() == 1 else 0  # rank 0: train then val; rank 1: val then train
        if lines == "one_line":  # one call site for both: only the samples can tell them apart
            built = [CachedDataset(data[(first + k) % 2], scope="node", capacity_bytes=CAP) for k in range(2)]
            return (built[0], built[1]) if first == 0 else (built[1], built[0])
        if first == 0:
            train = CachedDataset(data[0], scope="node", capacity_bytes=CAP)
            val = CachedDataset(data[1], scope="node", capacity_bytes=CAP)
        else:
            val = CachedDataset(data[1], scope="node", capacity_bytes=CAP)
            train = CachedDataset(data[0], scope="node", capacity_bytes=CAP)
        return train, val

    return _outcome(build)


@pytest.mark.parametrize("lines", ["one_line", "own_lines"])
def test_look_alike_caches_built_in_different_orders_raise_on_every_rank_instead_of_mixing(
    world: World, lines: str
) -> None:
    out = world(_orders, lines, nprocs=2, nproc_per_node=2, deadline=60)
    assert all("error" in r for r in out), f"paired silently; the ranks read as validation samples: {out}"
    assert {r["error"] for r in out} == {"ValueError"}, out
    message = out[0]["message"]
    assert all(r["message"] == message for r in out), out  # the same error on every rank
    assert "ranks [0]: builtins.list[4]#" in message and "ranks [1]: builtins.list[4]#" in message, message
    assert "same order on every rank" in message, message
    samples = set(re.findall(r"samples #([0-9a-f]{12})", message))
    assert len(samples) == 2, message  # both sides' sampled content, which differs
    if lines == "own_lines":
        assert len(set(re.findall(r"test_cache_pairing\.py:(\d+)#1", message))) == 2, message  # both call sites


def _same(_: None) -> dict[str, Any]:
    train, val = _splits()
    drawn = Drawn(4)  # random inside __getitem__: equal fingerprints only because the reads are seeded
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    caches = [CachedDataset(d, scope="node", capacity_bytes=CAP) for d in (train, val)]  # one line, in order
    caches.append(CachedDataset(drawn, scope="node", capacity_bytes=CAP))
    rngs_kept = (
        torch.equal(torch.get_rng_state(), states[0])
        and random.getstate() == states[1]
        and bool((np.random.get_state()[1] == states[2]).all())
    )
    if idist.get_rank() == 0:
        for cache in caches:
            [cache[i] for i in range(len(cache))]
    idist.barrier()
    values = [[float(cache[i].flatten()[0]) for i in range(len(cache))] for cache in caches[:2]]
    out = {
        "values": values,
        "hits": [cache.stats().hits for cache in caches],
        "segments": [cache.segment for cache in caches],
        "rngs_kept": rngs_kept,
    }
    idist.barrier()
    for cache in caches:
        cache.close()
    return out


class Drawn:
    """Four samples drawn from torch's global generator on every read, like a random transform inside a dataset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2) + i


def test_the_same_datasets_built_in_the_same_order_still_pair_and_share(world: World) -> None:
    out = world(_same, None, nprocs=2, nproc_per_node=2, deadline=60)
    assert [r["values"] for r in out] == [[[1.0] * 4, [-1.0] * 4]] * 2
    assert out[0]["segments"] == out[1]["segments"]  # one cache per dataset for the node
    assert len(set(out[0]["segments"])) == 3
    assert out[1]["hits"] == [4, 4, 0]  # rank 1 read what rank 0 stored (it did not read the drawn one)
    assert all(r["rngs_kept"] for r in out)  # the seeded reads left the global generators as they were


def _named() -> dict[str, Any]:
    train, val = _splits()
    rank = idist.get_rank()

    def different_samples() -> tuple[CachedDataset, CachedDataset]:
        # One explicit name for two different datasets: the name pairs them, the samples must not.
        own = CachedDataset(train if rank == 0 else val, scope="node", capacity_bytes=CAP, name="split")
        return own, own

    def same_samples_from_own_lines() -> tuple[CachedDataset, CachedDataset]:
        # The same dataset constructed from different lines on each rank: a name is how to pair them.
        if rank == 0:
            own = CachedDataset(val, scope="node", capacity_bytes=CAP, name="val")
        else:
            own = CachedDataset(val, scope="node", capacity_bytes=CAP, name="val")
        return CachedDataset(train, scope="node", capacity_bytes=CAP, name="train"), own

    def sites_only() -> tuple[CachedDataset, CachedDataset]:
        # Equal at the sampled indices (first, middle, last of 5), different elsewhere: only the call sites differ.
        a = [torch.full((3,), float(i)) for i in range(5)]
        b = [torch.full((3,), float(-i if i % 2 else i)) for i in range(5)]
        if rank == 0:
            first = CachedDataset(a, scope="node", capacity_bytes=CAP)
            second = CachedDataset(b, scope="node", capacity_bytes=CAP)
        else:
            first = CachedDataset(b, scope="node", capacity_bytes=CAP)
            second = CachedDataset(a, scope="node", capacity_bytes=CAP)
        return first, second

    return {
        "different_samples": _outcome(different_samples),
        "same_samples": _outcome(same_samples_from_own_lines),
        "sites_only": _outcome(sites_only),
    }


def test_an_explicit_name_pairs_only_caches_of_the_same_samples(world: World) -> None:
    out = world(_named, nprocs=2, nproc_per_node=2, deadline=60)
    refused = [r["different_samples"] for r in out]
    assert all(r.get("error") == "ValueError" for r in refused), refused
    assert refused[0]["message"] == refused[1]["message"]
    message = refused[0]["message"]
    assert "ranks [0]: 'split' (given), samples #" in message and "ranks [1]: 'split' (given), samples #" in message
    assert "different samples" in message and "[0, 2, 3]" in message, message
    assert [r["same_samples"] for r in out] == [{"val": [-1.0] * 4}] * 2  # a name still pairs across lines
    by_site = [r["sites_only"] for r in out]
    assert all(r.get("error") == "ValueError" for r in by_site), by_site
    assert len(set(re.findall(r"test_cache_pairing\.py:(\d+)#1", by_site[0]["message"]))) == 2, by_site


# ------------------------------------------------------------------------------ the identity, in one process


def test_the_sampled_indices_are_the_first_middle_and_last() -> None:
    from ignite_ext.data.cache.identity import fingerprint_indices

    assert [fingerprint_indices(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [
        (),
        (0,),
        (0, 1),
        (0, 1, 2),
        (0, 2, 3),
        (0, 2, 4),
        (0, 500, 999),
    ]


def test_a_sample_fingerprint_sees_values_reads_three_samples_and_leaves_the_rngs_alone() -> None:
    from ignite_ext.data.cache.identity import default_name, sample_fingerprint
    from tests.data.test_cache import CountingDataset

    train, val = _splits()
    assert default_name(train) == default_name(val)  # what the default name cannot see
    assert sample_fingerprint(train) != sample_fingerprint(val)
    assert sample_fingerprint(train) == sample_fingerprint([t.clone() for t in train])
    assert sample_fingerprint([np.ones(3)]) != sample_fingerprint([np.ones(3, dtype=np.float32)])
    assert sample_fingerprint([{"a": 1, "b": "x"}]) != sample_fingerprint([{"a": 1, "b": "y"}])
    assert sample_fingerprint([{1, 2, 3}]) == sample_fingerprint([{3, 2, 1}])
    assert sample_fingerprint([torch.ones(2, 2)]) != sample_fingerprint([torch.ones(4)])
    assert sample_fingerprint([]) == sample_fingerprint([])
    counting = CountingDataset(10)
    sample_fingerprint(counting)
    assert counting.loads() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert sample_fingerprint(Drawn(3)) == sample_fingerprint(Drawn(3))  # seeded reads: the same every time
    assert torch.equal(torch.get_rng_state(), before)


class LazyHandle:
    """Opens its "file" on first read, as HDF5 datasets do so that each DataLoader worker opens its own."""

    def __init__(self) -> None:
        self.handle: object | None = None

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        if self.handle is None:
            self.handle = object()
        return i


def test_a_sample_fingerprint_reads_through_a_copy_so_lazy_state_stays_unopened() -> None:
    from ignite_ext.data.cache.identity import sample_fingerprint

    ds = LazyHandle()
    sample_fingerprint(ds)
    assert ds.handle is None
    assert copy.copy(ds).handle is None


class BrokenCopy:
    """A dataset whose copies cannot read (its ``__getstate__`` leaves out the samples): read as it is."""

    def __init__(self) -> None:
        self.samples = [torch.ones(2), torch.zeros(2)]

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.samples[i]


def test_a_dataset_whose_copy_cannot_read_is_fingerprinted_as_it_is() -> None:
    from ignite_ext.data.cache.identity import sample_fingerprint

    assert sample_fingerprint(BrokenCopy()) == sample_fingerprint([torch.ones(2), torch.zeros(2)])


def _site() -> str:
    from ignite_ext.data.cache.identity import construction_site

    return construction_site()


def test_a_construction_site_is_the_callers_line_counted_per_line() -> None:
    from ignite_ext.data.cache.identity import construction_site

    loop = [construction_site() for _ in range(3)]
    line = loop[0].split("#")[0]
    assert re.fullmatch(r"test_cache_pairing\.py:\d+", line), loop
    assert loop == [f"{line}#1", f"{line}#2", f"{line}#3"]
    other = construction_site()
    assert other.endswith("#1") and other.split("#")[0] != line
    assert _site().startswith("test_cache_pairing.py:")  # this module's helper, not the package
