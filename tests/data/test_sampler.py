"""Invariants of ShardedDistributedSampler and its index maths, checked in one process."""

from __future__ import annotations

import itertools
import math
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ignite.engine import Engine, Events
from torch.utils.data import DataLoader, DistributedSampler

import ignite_ext.distributed as idist
from ignite_ext.data import ShardedDistributedSampler
from ignite_ext.data.sampler import node_shard_indices, samples_per_replica, shard_bounds, shard_indices

FAST = settings(deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

sizes = st.integers(0, 500)
worlds = st.integers(1, 16)
seeds = st.integers(-(2**40), 2**40)
epochs = st.integers(0, 10_000)


def own(n: int, r: int, s: int) -> set[int]:
    start, stop = shard_bounds(n, r, s)
    return set(range(start, stop))


def all_shards(n: int, r: int, seed: int, epoch: int, drop_last: bool, shuffle: bool) -> list[list[int]]:
    return [shard_indices(n, r, s, seed=seed, epoch=epoch, drop_last=drop_last, shuffle=shuffle) for s in range(r)]


# --- shard_bounds and lengths -------------------------------------------------------------------------------------


@FAST
@given(n=sizes, r=worlds)
def test_shards_are_contiguous_balanced_and_cover_the_dataset(n: int, r: int) -> None:
    bounds = [shard_bounds(n, r, s) for s in range(r)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, stop), (start, _) in itertools.pairwise(bounds):
        assert stop == start
    shard_sizes = [stop - start for start, stop in bounds]
    assert max(shard_sizes) - min(shard_sizes) <= 1
    assert all(size >= 0 for size in shard_sizes)


@FAST
@given(n=sizes, r=worlds, drop_last=st.booleans())
def test_length_matches_torch_distributed_sampler(n: int, r: int, drop_last: bool) -> None:
    dataset = range(n)
    for rank in {0, r - 1}:
        theirs = DistributedSampler(dataset, num_replicas=r, rank=rank, drop_last=drop_last)  # type: ignore[arg-type]
        ours = ShardedDistributedSampler(dataset, num_replicas=r, rank=rank, drop_last=drop_last)
        assert len(ours) == len(theirs) == samples_per_replica(n, r, drop_last)
        assert len(list(ours)) == len(list(theirs))
        assert ours.total_size == theirs.total_size


# --- rank sharding -------------------------------------------------------------------------------------------------


@FAST
@given(n=sizes, r=worlds, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_no_drop_every_index_every_epoch_and_only_own_padding(
    n: int, r: int, seed: int, epoch: int, shuffle: bool
) -> None:
    shards = all_shards(n, r, seed, epoch, drop_last=False, shuffle=shuffle)
    length = math.ceil(n / r)
    assert all(len(indices) == length for indices in shards)
    assert set().union(*shards) == set(range(n))
    for s, indices in enumerate(shards):
        mine = own(n, r, s)
        if mine:
            assert set(indices) == mine  # pads only with its own samples
            counts = Counter(indices)
            assert all(counts[i] >= 1 for i in mine)
            assert sum(c - 1 for c in counts.values()) == length - len(mine)
        else:
            # n < r: a shard with nothing of its own repeats one fixed sample.
            assert n < r and indices == ([s % n] if n else [])
    if n >= r:
        for a in range(r):
            for b in range(a + 1, r):
                assert not set(shards[a]) & set(shards[b])


@FAST
@given(n=sizes, r=worlds, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_drop_last_yields_distinct_own_samples_missing_at_most_one(
    n: int, r: int, seed: int, epoch: int, shuffle: bool
) -> None:
    shards = all_shards(n, r, seed, epoch, drop_last=True, shuffle=shuffle)
    length = n // r
    for s, indices in enumerate(shards):
        assert len(indices) == length == len(set(indices))
        mine = own(n, r, s)
        assert set(indices) <= mine
        assert len(mine) - length in (0, 1)
    flat = [i for indices in shards for i in indices]
    assert len(flat) == len(set(flat))


@FAST
@given(n=st.integers(1, 500), r=worlds, seed=seeds, start=st.integers(0, 1000), drop_last=st.booleans())
def test_same_set_every_epoch_and_left_out_or_padding_rotates(
    n: int, r: int, seed: int, start: int, drop_last: bool
) -> None:
    s = 0 if drop_last else r - 1  # a long shard sits at the start, a short one at the end
    mine = own(n, r, s)
    size = len(mine)
    length = samples_per_replica(n, r, drop_last)
    if size == 0 or size == length:
        per_epoch = [shard_indices(n, r, s, seed=seed, epoch=e, drop_last=drop_last) for e in range(start, start + 3)]
        assert len({frozenset(x) for x in per_epoch}) == 1
        return
    span = range(start, start + size)
    orders = [shard_indices(n, r, s, seed=seed, epoch=e, drop_last=drop_last) for e in span]
    if drop_last:
        left_out = [next(iter(mine - set(o))) for o in orders]
        # a different one each epoch: over `size` consecutive epochs each sample is left out exactly once
        assert sorted(left_out) == sorted(mine)
    else:
        extra = [next(i for i, c in Counter(o).items() if c == 2) for o in orders]
        assert all(set(o) == mine for o in orders)
        assert sorted(extra) == sorted(mine)


@FAST
@given(n=sizes, r=worlds, seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_no_shuffle_is_ascending_own_shard_then_padding(n: int, r: int, seed: int, epoch: int, drop_last: bool) -> None:
    for s in range(r):
        indices = shard_indices(n, r, s, seed=seed, epoch=epoch, drop_last=drop_last, shuffle=False)
        start, stop = shard_bounds(n, r, s)
        body = indices[: stop - start]
        assert body == sorted(body)
        if not drop_last and stop > start:
            assert body == list(range(start, stop))
        # seed plays no part without shuffling
        assert indices == shard_indices(n, r, s, seed=seed + 1, epoch=epoch, drop_last=drop_last, shuffle=False)


@FAST
@given(n=st.integers(40, 500), r=st.integers(1, 4), seed=seeds, epoch=epochs)
def test_shuffle_changes_with_epoch_and_shard_and_seed(n: int, r: int, seed: int, epoch: int) -> None:
    # shards of >= 10 samples: equal permutations by chance have probability <= 1/10!
    a = shard_indices(n, r, 0, seed=seed, epoch=epoch)
    assert a == shard_indices(n, r, 0, seed=seed, epoch=epoch)
    assert a != shard_indices(n, r, 0, seed=seed, epoch=epoch + 1)
    assert a != shard_indices(n, r, 0, seed=seed + 1, epoch=epoch)
    assert a != sorted(a)
    if r > 1:
        start, _ = shard_bounds(n, r, 1)
        assert a != [i - start for i in shard_indices(n, r, 1, seed=seed, epoch=epoch)]


def test_seed_and_epoch_are_not_merged_into_one_sum() -> None:
    assert shard_indices(100, 2, 0, seed=0, epoch=1) != shard_indices(100, 2, 0, seed=1, epoch=0)


def test_order_does_not_depend_on_creation_order_or_global_rng() -> None:
    def make(order: list[int]) -> dict[int, list[int]]:
        out = {}
        for rank in order:
            torch.manual_seed(1000 + rank)  # disturb the global generator between creations
            sampler = ShardedDistributedSampler(range(103), num_replicas=5, rank=rank, seed=3)
            sampler.set_epoch(2)
            torch.rand(7)
            out[rank] = list(sampler)
        return out

    assert make([0, 1, 2, 3, 4]) == make([4, 2, 0, 3, 1])


# --- the sampler object ---------------------------------------------------------------------------------------------


@FAST
@given(n=sizes, r=worlds, seed=seeds, epoch=epochs, drop_last=st.booleans(), shuffle=st.booleans())
def test_sampler_iterates_the_pure_function(
    n: int, r: int, seed: int, epoch: int, drop_last: bool, shuffle: bool
) -> None:
    rank = (seed % r + r) % r
    sampler = ShardedDistributedSampler(range(n), num_replicas=r, rank=rank, seed=seed, drop_last=drop_last,
                                        shuffle=shuffle)  # fmt: skip
    sampler.set_epoch(epoch)
    expected = shard_indices(n, r, rank, seed=seed, epoch=epoch, drop_last=drop_last, shuffle=shuffle)
    assert list(sampler) == expected == sampler.indices()
    assert list(sampler) == expected  # iterating again gives the same epoch
    assert isinstance(sampler, DistributedSampler)


def test_defaults_come_from_idist_in_serial_mode() -> None:
    assert idist.get_world_size() == 1
    sampler = ShardedDistributedSampler(range(7))
    assert (sampler.num_replicas, sampler.rank, sampler.num_shards, sampler.shard) == (1, 0, 1, 0)
    assert (sampler.nnodes, sampler.node_rank, sampler.nproc_per_node, sampler.local_rank) == (None,) * 4
    assert sorted(sampler) == list(range(7))
    node = ShardedDistributedSampler(range(7), shard_by="node")
    assert (node.nnodes, node.node_rank, node.nproc_per_node, node.local_rank) == (1, 0, 1, 0)
    assert sorted(node) == list(range(7))


def test_defaults_from_idist_are_used_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import ignite_ext.data.sampler.sharded as module

    fake = {"get_world_size": 6, "get_rank": 4, "get_nnodes": 3, "get_node_rank": 2, "get_nproc_per_node": 2,
            "get_local_rank": 0}  # fmt: skip
    for name, value in fake.items():
        monkeypatch.setattr(module.idist, name, lambda value=value: value)
    sampler = ShardedDistributedSampler(range(60), shard_by="node")
    assert (sampler.num_replicas, sampler.rank) == (6, 4)
    assert (sampler.nnodes, sampler.node_rank, sampler.nproc_per_node, sampler.local_rank) == (3, 2, 2, 0)
    assert (sampler.num_shards, sampler.shard) == (3, 2)
    assert set(sampler) <= set(range(40, 60))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_replicas": 4, "rank": 4}, ValueError, "rank=4 is out of range"),
        ({"num_replicas": 4, "rank": -1}, ValueError, "rank=-1 is out of range"),
        ({"num_replicas": 0, "rank": 0}, ValueError, "num_replicas must be >= 1"),
        ({"num_replicas": 2, "rank": True}, TypeError, "rank must be an int"),
        ({"num_replicas": 2, "rank": 0, "seed": 1.5}, TypeError, "seed must be an int"),
        ({"num_replicas": 2, "rank": 0, "shard_by": "host"}, ValueError, "shard_by must be one of"),
        ({"num_replicas": 2, "rank": 0, "nnodes": 2}, ValueError, "only apply to shard_by='node'"),
        ({"num_replicas": 6, "rank": 0, "shard_by": "node", "nnodes": 4}, ValueError, "not a multiple"),
        ({"num_replicas": 6, "rank": 0, "shard_by": "node", "nnodes": 2, "nproc_per_node": 2}, ValueError,
         "same number of processes"),
        ({"num_replicas": 6, "rank": 0, "shard_by": "node", "nnodes": 2, "node_rank": 2}, ValueError,
         "node_rank=2 is out of range"),
        ({"num_replicas": 6, "rank": 0, "shard_by": "node", "nproc_per_node": 3, "local_rank": 3}, ValueError,
         "local_rank=3 is out of range"),
        ({"num_replicas": 4, "rank": 0, "shard_by": "node"}, ValueError, "needs nnodes or nproc_per_node"),
    ],
)  # fmt: skip
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedDistributedSampler(range(10), **kwargs)


def test_numpy_and_torch_integers_are_accepted() -> None:
    import numpy as np

    sampler = ShardedDistributedSampler(range(10), num_replicas=np.int64(2), rank=torch.tensor(1))  # type: ignore[arg-type]
    sampler.set_epoch(np.int32(3))  # type: ignore[arg-type]
    assert (sampler.num_replicas, sampler.rank, sampler.epoch) == (2, 1, 3)
    assert type(sampler.epoch) is int
    assert list(sampler) == shard_indices(10, 2, 1, epoch=3)


def test_dataset_without_length_is_rejected() -> None:
    with pytest.raises(TypeError, match="must have a length"):
        ShardedDistributedSampler(iter(range(3)), num_replicas=1, rank=0)  # type: ignore[arg-type]


def test_pure_functions_validate_their_arguments() -> None:
    with pytest.raises(ValueError, match="shard=3 is out of range"):
        shard_bounds(10, 3, 3)
    with pytest.raises(ValueError, match="n must be >= 0"):
        samples_per_replica(-1, 2)
    with pytest.raises(ValueError, match="local_rank=2"):
        node_shard_indices(10, 2, 0, 2, 2)


# --- N < R ---------------------------------------------------------------------------------------------------------


@FAST
@given(n=st.integers(1, 15), extra=st.integers(1, 8), epoch=epochs, shuffle=st.booleans())
def test_fewer_samples_than_ranks(n: int, extra: int, epoch: int, shuffle: bool) -> None:
    r = n + extra
    samplers = [ShardedDistributedSampler(range(n), num_replicas=r, rank=k, shuffle=shuffle) for k in range(r)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    seen = [list(s) for s in samplers]
    assert seen == [[k] if k < n else [k % n] for k in range(r)]  # one each; the surplus ranks repeat k % n
    dropped = [ShardedDistributedSampler(range(n), num_replicas=r, rank=k, drop_last=True) for k in range(r)]
    assert all(len(s) == 0 and list(s) == [] for s in dropped)


def test_empty_dataset_yields_nothing() -> None:
    for drop_last in (False, True):
        sampler = ShardedDistributedSampler([], num_replicas=3, rank=2, drop_last=drop_last)
        assert len(sampler) == 0 and list(sampler) == []


# --- node sharding --------------------------------------------------------------------------------------------------


@FAST
@given(
    n=sizes,
    nnodes=st.integers(1, 4),
    nproc=st.integers(1, 4),
    seed=seeds,
    epoch=epochs,
    drop_last=st.booleans(),
    shuffle=st.booleans(),
)
def test_node_sharding_invariants(
    n: int, nnodes: int, nproc: int, seed: int, epoch: int, drop_last: bool, shuffle: bool
) -> None:
    r = nnodes * nproc
    length = samples_per_replica(n, r, drop_last)
    per_node: list[list[int]] = []
    for node in range(nnodes):
        ranks = [
            ShardedDistributedSampler(range(n), num_replicas=r, rank=node * nproc + lr, seed=seed,
                                      drop_last=drop_last, shuffle=shuffle, shard_by="node", nproc_per_node=nproc)
            for lr in range(nproc)
        ]  # fmt: skip
        assert [(s.node_rank, s.local_rank) for s in ranks] == [(node, lr) for lr in range(nproc)]
        for s in ranks:
            s.set_epoch(epoch)
        lists = [list(s) for s in ranks]
        assert all(len(x) == len(s) == length for x, s in zip(lists, ranks, strict=True))
        node_indices = [i for x in lists for i in x]
        mine = own(n, nnodes, node)
        if not mine and node_indices:
            mine = {node % n}  # n < nnodes: an empty node shard repeats one fixed sample
        assert set(node_indices) <= mine
        if not drop_last:
            assert set(node_indices) == mine
        else:
            assert len(node_indices) == len(set(node_indices))
        per_node.append(node_indices)
    if not drop_last:
        assert set().union(*map(set, per_node)) == set(range(n))
    if n >= nnodes:
        for a in range(nnodes):
            for b in range(a + 1, nnodes):
                assert not set(per_node[a]) & set(per_node[b])


@FAST
@given(n=st.integers(64, 500), nnodes=st.integers(1, 3), nproc=st.integers(2, 4), seed=seeds, epoch=epochs)
def test_node_shuffle_mixes_samples_across_the_nodes_ranks(
    n: int, nnodes: int, nproc: int, seed: int, epoch: int
) -> None:
    a = set(node_shard_indices(n, nnodes, 0, nproc, 0, seed=seed, epoch=epoch))
    b = set(node_shard_indices(n, nnodes, 0, nproc, 0, seed=seed, epoch=epoch + 1))
    assert a != b  # the same node shard, dealt differently: local rank 0 loads other samples
    strided = node_shard_indices(n, nnodes, 0, nproc, 1, seed=seed, epoch=epoch, shuffle=False)
    start, _ = shard_bounds(n, nnodes, 0)
    assert strided[:3] == [start + 1, start + 1 + nproc, start + 1 + 2 * nproc]


# --- state_dict / resume --------------------------------------------------------------------------------------------


@FAST
@given(
    n=st.integers(0, 300),
    r=worlds,
    seed=seeds,
    epoch=st.integers(0, 50),
    cut=st.floats(0, 1),
    drop_last=st.booleans(),
    by_node=st.booleans(),
)
def test_resume_mid_epoch_is_exact(
    n: int, r: int, seed: int, epoch: int, cut: float, drop_last: bool, by_node: bool
) -> None:
    node_kwargs: dict[str, Any] = {"shard_by": "node", "nproc_per_node": 2} if by_node and r % 2 == 0 else {}

    def make() -> ShardedDistributedSampler:
        return ShardedDistributedSampler(range(n), num_replicas=r, rank=r - 1, seed=seed, drop_last=drop_last,
                                         **node_kwargs)  # fmt: skip

    first = make()
    first.set_epoch(epoch)
    full = first.indices()
    k = int(cut * len(full))
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    assert state["epoch"] == epoch and state["consumed"] == k

    second = make()
    second.load_state_dict(state)
    assert second.state_dict() == state
    second.set_epoch(epoch)  # an EPOCH_STARTED handler re-setting the same epoch keeps the position
    assert head + list(second) == full
    assert list(second) == full  # only the first iteration after loading is shortened
    second.set_epoch(epoch + 1)
    assert list(second) == make().indices(epoch + 1)


def test_set_epoch_to_a_new_epoch_discards_a_loaded_position() -> None:
    sampler = ShardedDistributedSampler(range(40), num_replicas=2, rank=0)
    sampler.load_state_dict({"epoch": 3, "consumed": 5})
    sampler.set_epoch(4)
    assert sampler.state_dict()["consumed"] == 0
    assert list(sampler) == sampler.indices(4)


def test_state_counts_only_the_latest_iterator() -> None:
    sampler = ShardedDistributedSampler(range(40), num_replicas=2, rank=0)
    old = iter(sampler)
    next(old)
    new = iter(sampler)
    next(new), next(new), next(old)
    assert sampler.state_dict()["consumed"] == 2


@pytest.mark.parametrize(
    "change", [{"num_replicas": 3, "rank": 2}, {"shard_by": "node", "nnodes": 2}], ids=["num_replicas", "shard_by"]
)
def test_state_from_another_world_continues_the_epoch_restriped(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {"dataset": range(60), "num_replicas": 4, "rank": 2, "seed": 0}
    old = ShardedDistributedSampler(**base)
    old.set_epoch(5)
    it = iter(old)
    for _ in range(7):
        next(it)
    new = ShardedDistributedSampler(**{**base, **change})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new.load_state_dict(old.state_dict())
    assert new.epoch == 5
    rest = list(new)
    assert len(rest) == -(-(60 - 4 * 7) // new.num_replicas)  # a share of the 32 left, not a whole epoch
    assert not set(rest) & {
        i for r in range(4) for i in ShardedDistributedSampler(**{**base, "rank": r}).indices(5)[:7]
    }
    assert list(new) == new.indices(5)  # a second pass of the epoch is the new world's whole epoch


@pytest.mark.parametrize(
    ("change", "key"),
    [({"seed": 1}, "seed"), ({"dataset": range(50)}, "dataset_len"), ({"shuffle": False}, "shuffle"),
     ({"drop_last": True}, "drop_last")],
)  # fmt: skip
def test_state_from_another_dataset_or_seed_is_an_error(change: dict[str, Any], key: str) -> None:
    base: dict[str, Any] = {"dataset": range(60), "num_replicas": 4, "rank": 2, "seed": 0}
    old = ShardedDistributedSampler(**base)
    new = ShardedDistributedSampler(**{**base, **change})
    with pytest.raises(ValueError, match=f"saved with {key}=.*this sampler has {key}=.*name other samples"):
        new.load_state_dict(old.state_dict(consumed=3))
    assert list(new) == new.indices()  # nothing was loaded


def test_bad_states_are_rejected() -> None:
    sampler = ShardedDistributedSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="missing"):
        sampler.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="more than the 5 indices"):
        sampler.load_state_dict({"epoch": 1, "consumed": 6})
    with pytest.raises(ValueError, match="consumed must be >= 0"):
        sampler.load_state_dict({"epoch": 1, "consumed": -1})
    with pytest.raises(TypeError, match="epoch must be an int"):
        sampler.load_state_dict({"epoch": "1", "consumed": 0})
    with pytest.raises(ValueError, match="consumed must be >= 0"):
        sampler.state_dict(consumed=-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.load_state_dict({"epoch": 1, "consumed": 5})  # the same layout: no warning
    assert list(sampler) == []


def test_single_process_loader_state_counts_consumed_batches_exactly() -> None:
    sampler = ShardedDistributedSampler(range(50), num_replicas=2, rank=1, seed=4)
    loader = DataLoader(range(50), batch_size=4, sampler=sampler)
    batches = iter(loader)
    for k in range(1, 4):
        next(batches)
        assert sampler.state_dict()["consumed"] == 4 * k


def _worker_loader(sampler: ShardedDistributedSampler) -> DataLoader[int]:
    return DataLoader(range(200), batch_size=5, sampler=sampler, num_workers=2, prefetch_factor=2)


@pytest.mark.distributed  # DataLoader worker processes
def test_prefetching_loader_needs_the_loops_count_and_then_resumes_exactly() -> None:
    make = lambda: ShardedDistributedSampler(range(200), num_replicas=2, rank=0, seed=9)  # noqa: E731
    sampler = make()
    batches = iter(_worker_loader(sampler))
    head = [int(i) for _ in range(3) for i in next(batches)]
    assert sampler.state_dict()["consumed"] > 15  # the workers ran ahead of the loop
    sampler.set_consumed(15)
    state = sampler.state_dict()
    del batches
    resumed = make()
    resumed.load_state_dict(state)
    tail = [int(i) for batch in _worker_loader(resumed) for i in batch]
    assert head + tail == make().indices()


def test_set_consumed_caps_and_resets() -> None:
    sampler = ShardedDistributedSampler(range(10), num_replicas=2, rank=0)
    sampler.set_consumed(99)
    assert sampler.state_dict()["consumed"] == 5
    assert sampler.state_dict(consumed=2)["consumed"] == 2
    list(sampler)
    assert sampler.state_dict()["consumed"] == 5  # a finished epoch, counted by the iterator again
    sampler.set_epoch(1)
    assert sampler.state_dict()["consumed"] == 0


def _train(sampler: ShardedDistributedSampler, loader: DataLoader[Any], seen: list[int], stop_at: int | None) -> Engine:
    def step(engine: Engine, batch: torch.Tensor) -> None:
        seen.extend(int(i) for i in batch)

    engine = Engine(step)

    @engine.on(Events.EPOCH_STARTED)
    def _set_epoch(engine: Engine) -> None:
        sampler.set_epoch(engine.state.epoch - 1)

    if stop_at is not None:

        @engine.on(Events.ITERATION_COMPLETED(once=stop_at))
        def _stop(engine: Engine) -> None:
            engine.terminate()

    return engine


@pytest.mark.parametrize(("stop_at", "saved"), [(8, (1, 18)), (10, (1, 30)), (3, (0, 18))])
def test_ignite_engine_resumes_without_repeating_or_skipping(stop_at: int, saved: tuple[int, int]) -> None:
    def make() -> tuple[ShardedDistributedSampler, DataLoader[Any]]:
        sampler = ShardedDistributedSampler(range(90), num_replicas=3, rank=1, seed=5)
        return sampler, DataLoader(range(90), batch_size=6, sampler=sampler)

    reference: list[int] = []
    sampler, loader = make()
    _train(sampler, loader, reference, None).run(loader, max_epochs=3)

    seen: list[int] = []
    sampler, loader = make()
    engine = _train(sampler, loader, seen, stop_at=stop_at)  # 5 iterations per epoch; 10 ends epoch 2
    engine.run(loader, max_epochs=3)
    saved_engine, saved_sampler = engine.state_dict(), sampler.state_dict()
    assert (saved_sampler["epoch"], saved_sampler["consumed"]) == saved

    sampler, loader = make()
    engine = _train(sampler, loader, seen, None)
    engine.load_state_dict(saved_engine)
    sampler.load_state_dict(saved_sampler)
    engine.run(loader)
    assert seen == reference


# --- the benchmark --------------------------------------------------------------------------------------------------


def test_benchmark_contract_and_cache_claims() -> None:
    from benchmarks import bench_sampler

    result = bench_sampler.run(quick=True)
    assert bench_sampler.NAME == "sampler"
    assert {"title", "machine", "rows", "summary", "plot"} <= set(result)
    rows = result["rows"]
    assert [r["ours_hit_pct"] for r in rows] == [0.0, 100.0, 100.0, 100.0]
    assert all(r["ours_cache_per_rank"] == 2_000 // 4 for r in rows)
    assert all(r["ours_node_cache_per_node"] == 2_000 // 2 for r in rows)
    assert all(0 < r["torch_hit_pct"] < 75 for r in rows[1:])  # torch reshuffles across ranks
    assert rows[-1]["torch_cache_per_rank"] > 2_000 // 2
    assert {result["plot"]["x"], *result["plot"]["y"]} <= set(rows[0])
