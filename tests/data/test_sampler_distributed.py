"""ShardedDistributedSampler in real gloo worlds, through idist.auto_dataloader."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests._world import World

N = 203  # not a multiple of 4: some shards pad
EPOCHS = 2


def _seen_per_epoch(shard_by: str, n: int, epochs: int) -> dict[str, Any]:
    from ignite.contrib.engines.common import setup_common_training_handlers
    from ignite.engine import Engine

    import ignite_ext.distributed as idist
    from ignite_ext.data import ShardedDistributedSampler

    sampler = ShardedDistributedSampler(list(range(n)), seed=11, shard_by=shard_by)
    # batch_size 8 over 4 ranks: auto_dataloader gives each rank batches of 2
    loader = idist.auto_dataloader(list(range(n)), batch_size=8, sampler=sampler)
    seen: list[list[int]] = []

    def step(engine: Engine, batch: Any) -> None:
        if engine.state.iteration % engine.state.epoch_length == 1:
            seen.append([])
        seen[-1].extend(int(i) for i in batch)

    trainer = Engine(step)
    # ignite's own handlers call set_epoch; they accept the sampler because it is a DistributedSampler
    setup_common_training_handlers(trainer, train_sampler=sampler, with_pbars=False, stop_on_nan=False)
    trainer.run(loader, max_epochs=epochs)
    return {
        "rank": idist.get_rank(),
        "node": (sampler.node_rank, sampler.local_rank) if shard_by == "node" else None,
        "idist_node": (idist.get_node_rank(), idist.get_local_rank()),
        "same_sampler": loader.sampler is sampler,
        "len": len(sampler),
        "epoch": sampler.epoch,
        "seen": seen,
    }


@pytest.mark.distributed
def test_four_ranks_keep_disjoint_shards_that_cover_the_dataset(world: World) -> None:
    results = world(_seen_per_epoch, "rank", N, EPOCHS)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["same_sampler"] for r in results)  # auto_dataloader used it as is, not a proxy
    assert all(r["epoch"] == EPOCHS - 1 and len(r["seen"]) == EPOCHS for r in results)
    length = -(-N // 4)
    assert all(r["len"] == length for r in results)
    for epoch in range(EPOCHS):
        sets = [set(r["seen"][epoch]) for r in results]
        assert all(len(r["seen"][epoch]) == length for r in results)
        assert set().union(*sets) == set(range(N))
        for a in range(4):
            for b in range(a + 1, 4):
                assert not sets[a] & sets[b]
        for r in results:  # each shard is contiguous
            assert sorted(set(r["seen"][epoch])) == list(range(min(r["seen"][epoch]), max(r["seen"][epoch]) + 1))
    for r in results:
        assert set(r["seen"][0]) == set(r["seen"][1])  # the same shard every epoch...
        assert r["seen"][0] != r["seen"][1]  # ...in a new order


@pytest.mark.distributed
@pytest.mark.multinode
def test_two_nodes_of_two_ranks_share_node_shards(world: World) -> None:
    results = world(_seen_per_epoch, "node", N, EPOCHS, nproc_per_node=2)
    assert [r["node"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["idist_node"] for r in results] == [r["node"] for r in results]  # defaults came from idist
    length = -(-N // 4)
    assert all(r["len"] == length and all(len(s) == length for s in r["seen"]) for r in results)
    node_sets = []
    for epoch in range(EPOCHS):
        per_node = [set(results[0]["seen"][epoch]) | set(results[1]["seen"][epoch]),
                    set(results[2]["seen"][epoch]) | set(results[3]["seen"][epoch])]  # fmt: skip
        assert not per_node[0] & per_node[1]
        assert per_node[0] | per_node[1] == set(range(N))
        node_sets.append(per_node)
        for node in (0, 1):  # the two ranks of a node only share the node's padding
            pair = Counter(results[2 * node]["seen"][epoch] + results[2 * node + 1]["seen"][epoch])
            assert sum(c - 1 for c in pair.values()) == 2 * length - len(per_node[node])
    assert node_sets[0] == node_sets[1]  # a node keeps its shard...
    for r in results:
        assert set(r["seen"][0]) != set(r["seen"][1])  # ...but deals it to its ranks differently each epoch
