"""CachedDataset across 4 gloo ranks: node scope shares one segment per node; samplers and hit rates; cleanup."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from typing import Any

import ignite.distributed as idist
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ignite_ext.data import CachedDataset, ShardedDistributedSampler
from ignite_ext.data.cache import ShmSpaceError
from ignite_ext.data.cache.codec import LENDABLE
from tests._world import World
from tests.data.test_cache import CountingDataset, fingerprint_loads
from tests.data.test_cache_cow import lent

N, EPOCHS = 32, 3


def _train(base: CountingDataset, scope: str, sampler_kind: str) -> dict[str, Any]:
    # Ranks are daemonic so that a stuck world is always reaped; DataLoader workers still need to be their
    # children (they exit by themselves when their rank does).
    mp.current_process().daemon = False
    capacity = max(4 << 20, N * (4 * base.size + 8192))
    ds = CachedDataset(base, scope=scope, capacity_bytes=capacity)  # type: ignore[arg-type]
    sampler: DistributedSampler[int]
    if sampler_kind == "torch":
        sampler = DistributedSampler(ds, shuffle=True, seed=0)
    else:
        sampler = ShardedDistributedSampler(ds, shard_by=sampler_kind)  # type: ignore[arg-type]
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    rates, seen, prev = [], set(), ds.stats()
    for e in range(EPOCHS):
        sampler.set_epoch(e)
        for batch in dl:
            assert torch.equal(batch["x"][:, 0], batch["i"].float())
            seen.update(batch["i"].tolist())
        idist.barrier()  # an epoch's loads are published before any rank starts the next
        now = ds.stats()
        rates.append((now - prev).hit_rate)
        prev = now
    sample = ds[min(seen)]  # in the cache by now: a large one is lent from it (an attached rank's mapping too)
    lent_here = lent(sample["x"], ds)
    del sample
    prev = ds.stats()
    world, node = ds.stats(reduce="world"), ds.stats(reduce="node")
    rejected = []
    # Every rank invalid; then rank 1 alone invalid; then rank 1 alone asking for another reduction.
    for asked in ("host", "host" if idist.get_rank() == 1 else "world", "node" if idist.get_rank() == 1 else "world"):
        try:
            ds.stats(reduce=asked)  # type: ignore[arg-type]
            rejected.append(False)
        except ValueError as exc:
            rejected.append("same on every rank" in str(exc))
    assert ds.stats(reduce="world") == world  # the rejected calls left every rank's collectives in step
    segment = ds.segment
    if idist.get_local_rank() != 0:
        ds.close()  # ranks that attached must not delete the node's segment
    idist.barrier()
    kept = os.path.exists(segment)
    idist.barrier()
    ds.close()
    idist.barrier()
    return {
        "node": idist.get_node_rank(),
        "segment": segment,
        "rates": rates,
        "own": dataclasses.astuple(prev),
        "world": dataclasses.astuple(world),
        "node_stats": dataclasses.astuple(node),
        "seen": sorted(seen),
        "rejected": rejected,
        "kept": kept,
        "gone": not os.path.exists(segment),
        "lent": lent_here,
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("scope", "sampler_kind", "nproc_per_node", "size"),
    [
        ("node", "torch", 4, 256),  # one node: every rank's epoch-0 loads serve all ranks afterwards
        ("node", "torch", 4, LENDABLE // 4),  # the same with samples large enough to be lent copy-on-write
        ("node", "torch", 2, 256),  # two nodes: a node only has what its own ranks loaded
        ("node", "node", 2, 256),  # ShardedDistributedSampler(shard_by="node") pairs with node scope
        ("rank", "rank", 4, 256),  # ShardedDistributedSampler(shard_by="rank") pairs with rank scope
    ],
)
def test_caches_across_ranks(world: World, scope: str, sampler_kind: str, nproc_per_node: int, size: int) -> None:
    base = CountingDataset(N, size=size, context="forkserver")
    out = world(_train, base, scope, sampler_kind, nproc_per_node=nproc_per_node, deadline=120)
    # Through the cache: less the fingerprint reads at a node cache's construction (each rank, 3 samples).
    extra = fingerprint_loads(N, 4) if scope == "node" else [0] * N
    loads = [total - fingerprint for total, fingerprint in zip(base.loads(), extra, strict=True)]
    nodes = 4 // nproc_per_node
    segments = {r["segment"] for r in out}
    assert len(segments) == (nodes if scope == "node" else 4)
    for r in out:
        assert r["rejected"] == [True] * 3 and r["gone"]
        assert r["lent"] == (4 * size >= LENDABLE)
        if scope == "node":
            assert r["segment"] == out[r["node"] * nproc_per_node]["segment"]  # one per node
            assert r["kept"]
    world = out[0]["world"]
    assert all(r["world"] == world for r in out)
    assert tuple(map(sum, zip(*(r["own"] for r in out), strict=True))) == world
    hits, misses, entries = world[:3]
    assert hits + misses == N * EPOCHS + 4  # each rank's extra read of one sample
    assert entries == misses == sum(loads)  # every load was published once, none was lost
    if sampler_kind == "torch" and nodes == 1:
        assert loads == [1] * N
        assert all(r["rates"][1:] == [1.0] * (EPOCHS - 1) for r in out)
    elif sampler_kind == "torch":
        assert max(loads) <= nodes and sum(loads) > N  # a node reloads what only the other node had
        for node in range(nodes):
            ranks = [r for r in out if r["node"] == node]
            assert ranks[0]["node_stats"][2] == len(set().union(*(r["seen"] for r in ranks)))
    else:  # fixed shards: everything is loaded once, every later epoch is all hits
        assert loads == [1] * N
        assert all(r["rates"] == [0.0] + [1.0] * (EPOCHS - 1) for r in out)


def _sizes(base: CountingDataset) -> bool:
    if idist.get_local_rank() == 0:
        base = CountingDataset(N + 1, context="fork")  # a different dataset on one node's leader
    try:
        CachedDataset(base, scope="node", capacity_bytes=1 << 20)
    except ValueError as exc:
        return "different lengths" in str(exc)
    return False


@pytest.mark.distributed
def test_node_scope_rejects_ranks_with_different_datasets_on_every_rank(world: World) -> None:
    base = CountingDataset(N, context="forkserver")
    assert world(_sizes, base, nproc_per_node=2, deadline=60) == [True] * 4


def test_without_a_process_group_node_scope_is_a_local_cache() -> None:
    ds = CachedDataset(list(range(3)), scope="node", capacity_bytes=1 << 20)
    assert [ds[i] for i in (0, 1, 0)] == [0, 1, 0]
    assert ds.stats(reduce="node") == ds.stats(reduce="world") == ds.stats()
    ds.close()


def _val_first(train: CountingDataset, val: CountingDataset) -> str:
    # Local rank 1 of each node builds its validation cache first, as a rank that evaluates before training would.
    order = (val, train) if idist.get_local_rank() == 1 else (train, val)
    try:
        first = CachedDataset(order[0], scope="node", capacity_bytes=1 << 20)
        second = CachedDataset(order[1], scope="node", capacity_bytes=1 << 20)
    except ValueError as exc:
        return str(exc)
    caches = {id(order[0]): first, id(order[1]): second}
    if idist.get_local_rank() == 0:
        caches[id(train)][0]  # stores training sample 0
    idist.barrier()
    return f"no error; validation sample 0 is {caches[id(val)][0]['x'][0].item()}"  # 1000.0 unless mixed


@pytest.mark.distributed
def test_node_caches_built_in_different_orders_raise_on_every_rank_instead_of_mixing(world: World) -> None:
    train, val = CountingDataset(N, context="forkserver"), CountingDataset(N, offset=1000, context="forkserver")
    messages = world(_val_first, train, val, nproc_per_node=2, deadline=60)
    for message in messages:
        assert "construct different caches at this call" in message, messages
        assert "same order on every rank" in message and "name=" in message
        assert CachedDataset.__module__ not in message  # names are the datasets', not the cache's
        assert message.count("CountingDataset[32]#") == 4  # two nodes, two names each
    assert len(set(messages)) == 1
    # Read only by the fingerprints (one rank of each node per dataset), never through a cache.
    assert train.loads() == val.loads() == fingerprint_loads(N, 2)


def _named(base: CountingDataset, explicit: bool) -> tuple[str, float] | str:
    # A public attribute that differs by rank, though the samples do not: the default names differ.
    base.delay = 0.001 * idist.get_local_rank()
    try:
        ds = CachedDataset(base, scope="node", capacity_bytes=1 << 20, name="shapes/train" if explicit else None)
    except ValueError as exc:
        return str(exc)
    if idist.get_local_rank() == 0:
        ds[3]
    idist.barrier()
    value = ds[3]["x"][0].item()  # from the node's one cache: loaded once per node
    idist.barrier()
    ds.close()
    return ds.name, value


@pytest.mark.distributed
def test_the_same_name_on_every_rank_pairs_node_caches_that_default_names_would_not(world: World) -> None:
    base = CountingDataset(N, context="forkserver")
    refused = world(_named, base, False, nproc_per_node=2, deadline=60)
    assert all("different caches" in str(r) and "node 1, by local rank" in str(r) for r in refused), refused
    assert world(_named, base, True, nproc_per_node=2, deadline=60) == [("shapes/train", 3.0)] * 4
    assert base.loads()[3] == 2  # once per node


def _too_large(base: CountingDataset) -> str:
    capacity = 1 << 60 if idist.get_node_rank() == 1 else 1 << 20  # node 1's creating rank cannot have its cache
    try:
        CachedDataset(base, scope="node", capacity_bytes=capacity)
    except ShmSpaceError as exc:
        return str(exc)
    return "created"


@pytest.mark.distributed
def test_a_node_cache_that_does_not_fit_raises_on_every_rank(world: World) -> None:
    messages = world(_too_large, CountingDataset(N, context="forkserver"), nproc_per_node=2, deadline=60)
    assert all(m.startswith("creating the node cache failed on rank(s) [2]") for m in messages), messages
