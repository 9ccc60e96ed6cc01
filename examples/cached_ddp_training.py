"""Cached DDP training: every sample is loaded from storage once, later epochs read it from shared memory.

``ShardedDistributedSampler`` gives each rank the same shard every epoch (shuffled within it), and
``CachedDataset`` keeps the samples a rank has loaded in shared memory, where its DataLoader workers find them.
A small model trains with ignite's ``create_supervised_trainer`` over 4 gloo ranks, and ``CacheStatsHandler``
reports the cache hit rate of each epoch over the world: 0% in the first epoch, 100% after.

``--node`` caches per node instead (``scope="node"`` with ``shard_by="node"``): the ranks of a node share one
cache and the node's shard, so a node loads each of its samples once whichever of its ranks reads it.

Run it::

    python examples/cached_ddp_training.py
    python examples/cached_ddp_training.py --node
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from ignite.engine import Engine, Events, create_supervised_trainer
from torch import nn
from torch.utils.data import Dataset

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset, CacheStatsHandler, ShardedDistributedSampler

NUM_CLASSES = 10
FEATURES = 32


class SlowDataset(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic samples that take ``load_seconds`` each to load, like files read and decoded from storage."""

    def __init__(self, size: int, load_seconds: float = 0.002) -> None:
        self.size, self.load_seconds = size, load_seconds
        self.centers = torch.randn(NUM_CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.load_seconds)
        label = index % NUM_CLASSES
        noise = torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))
        return self.centers[label] + noise, label


def training(local_rank: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    shard_by = "node" if args.node else "rank"
    dataset = CachedDataset(SlowDataset(args.samples), scope=shard_by)
    sampler = ShardedDistributedSampler(dataset, shard_by=shard_by)
    loader = idist.auto_dataloader(
        dataset,
        batch_size=args.batch_size,  # the global batch: auto_dataloader splits it over the ranks
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        # Ranks started with "spawn" would also spawn their workers, each importing torch again; fork starts them
        # at once. The cache works with either.
        multiprocessing_context="fork" if args.workers > 0 else None,
    )
    model = idist.auto_model(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES)))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = create_supervised_trainer(model, optimizer, nn.CrossEntropyLoss(), device=idist.device())
    CacheStatsHandler(dataset, reduce="world").attach(trainer, name="cache")

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Engine) -> None:
        m = engine.state.metrics
        if idist.get_rank() == 0:
            print(
                f"epoch {engine.state.epoch}: cache hit rate {m['cache/hit_rate']:.0%} ({m['cache/hits']} hits, "
                f"{m['cache/misses']} loads), loss {engine.state.output:.3f}",
                flush=True,
            )

    trainer.run(loader, max_epochs=args.epochs)
    with idist.rank_scheduler(order=idist.Ordered()):
        print(f"rank {idist.get_rank()}: {len(sampler)} samples per epoch, {dataset.stats()}", flush=True)
    dataset.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--node", action="store_true", help='one cache per node: scope="node", shard_by="node"')
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    parser.add_argument("--samples", type=int, default=512, help="dataset size (default 512)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (default 1)")
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork"], help="fork: faster, CPU only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)
    with idist.Parallel(backend="gloo", nproc_per_node=args.nproc, start_method=args.start_method) as parallel:
        parallel.run(training, args)
