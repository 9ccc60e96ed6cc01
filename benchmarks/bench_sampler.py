"""Per-rank cache hit rate and cache size: ShardedDistributedSampler against torch's DistributedSampler.

A rank's "cache" is the set of dataset indices it has loaded so far; a request is a hit when the index is already
in it. Ranks are simulated in one process by building each rank's sampler with explicit ``num_replicas`` and
``rank``, which gives exactly the indices a real world would see. Counts, not timings, so the numbers are the same
on every machine.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from benchmarks._report import print_result
from ignite_ext.data import ShardedDistributedSampler

NAME = "sampler"

RANKS = 4
NPROC_PER_NODE = 2
EPOCHS = 4


def _simulate(samplers: list[DistributedSampler[int]], caches: int, cache_of: list[int]) -> list[dict[str, Any]]:
    """Run every sampler for EPOCHS epochs; ``cache_of[r]`` says which shared cache rank ``r`` reads and fills."""
    seen: list[set[int]] = [set() for _ in range(caches)]
    per_epoch = []
    for epoch in range(EPOCHS):
        hits = [0] * len(samplers)
        requests = [0] * len(samplers)
        for rank, sampler in enumerate(samplers):
            sampler.set_epoch(epoch)
            cache = seen[cache_of[rank]]
            for index in sampler:
                requests[rank] += 1
                if index in cache:
                    hits[rank] += 1
                else:
                    cache.add(index)
        per_epoch.append(
            {
                "hit_pct": [100.0 * h / max(q, 1) for h, q in zip(hits, requests, strict=True)],
                "entries": [len(seen[cache_of[rank]]) for rank in range(len(samplers))],
            }
        )
    return per_epoch


def run(quick: bool = False) -> dict[str, Any]:
    n = 2_000 if quick else 10_000
    dataset = range(n)
    torch_samplers: list[DistributedSampler[int]] = [
        DistributedSampler(dataset, num_replicas=RANKS, rank=r, seed=0)  # type: ignore[arg-type]
        for r in range(RANKS)
    ]
    ours: list[DistributedSampler[int]] = [
        ShardedDistributedSampler(dataset, num_replicas=RANKS, rank=r, seed=0) for r in range(RANKS)
    ]
    nnodes = RANKS // NPROC_PER_NODE
    by_node: list[DistributedSampler[int]] = [
        ShardedDistributedSampler(dataset, num_replicas=RANKS, rank=r, shard_by="node", nproc_per_node=NPROC_PER_NODE)
        for r in range(RANKS)
    ]
    theirs_run = _simulate(torch_samplers, RANKS, list(range(RANKS)))
    ours_run = _simulate(ours, RANKS, list(range(RANKS)))
    node_run = _simulate(by_node, nnodes, [r // NPROC_PER_NODE for r in range(RANKS)])

    def mean(xs: list[float] | list[int]) -> float:
        return sum(xs) / len(xs)

    def spread(xs: list[float]) -> str:
        return "/".join(f"{x:.0f}" for x in xs)

    rows = []
    for epoch in range(EPOCHS):
        t, o, nd = theirs_run[epoch], ours_run[epoch], node_run[epoch]
        rows.append(
            {
                "epoch": epoch,
                "ours_hit_pct": round(mean(o["hit_pct"]), 1),
                "torch_hit_pct": round(mean(t["hit_pct"]), 1),
                "ours_node_hit_pct": round(mean(nd["hit_pct"]), 1),
                "ours_hit_pct_per_rank": spread(o["hit_pct"]),
                "torch_hit_pct_per_rank": spread(t["hit_pct"]),
                "ours_cache_per_rank": round(mean(o["entries"])),
                "torch_cache_per_rank": round(mean(t["entries"])),
                "ours_node_cache_per_node": round(mean(nd["entries"])),
            }
        )
    first, last = rows[1], rows[-1]
    summary = (
        f"N={n}, {RANKS} ranks, {EPOCHS} epochs. Per-rank cache hit rate, epochs 0-{EPOCHS - 1}: ours "
        + "/".join(f"{r['ours_hit_pct']:.0f}" for r in rows)
        + " %, torch DistributedSampler "
        + "/".join(f"{r['torch_hit_pct']:.0f}" for r in rows)
        + f" %. Cache after {EPOCHS} epochs: ours {last['ours_cache_per_rank']} entries per rank (N/R = {n // RANKS}),"
        f" torch {last['torch_cache_per_rank']} ({last['torch_cache_per_rank'] / n:.2f} N)."
        f" shard_by='node' ({nnodes} nodes x {NPROC_PER_NODE}): {first['ours_node_hit_pct']:.0f} % node-cache hits"
        f" from epoch 1, {last['ours_node_cache_per_node']} entries per node."
    )
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return {
        "title": "Per-rank cache hit rate: ShardedDistributedSampler vs torch DistributedSampler",
        "machine": f"{machine}, torch {torch.__version__}",
        "rows": rows,
        "summary": summary,
        "plot": {"x": "epoch", "y": ["ours_hit_pct", "torch_hit_pct", "ours_node_hit_pct"], "kind": "bar"},
    }


if __name__ == "__main__":
    print_result(run())
