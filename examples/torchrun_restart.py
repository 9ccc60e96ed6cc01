"""A job torchrun restarts: the restarted attempt's first epoch is served from the cache the failed attempt left.

A small model trains over a node cache (``CachedDataset(scope="node")`` with ``ShardedDistributedSampler``) under
the real launcher. In the first attempt, rank 1 fails in the second epoch (``--fail raise``: an exception;
``--fail kill``: SIGKILL); torchrun stops the other rank and starts the group again. The restarted group forms on
a store of its own (nothing of the failed attempt is read), adopts the node cache the failed attempt left, and
its first epoch loads nothing from storage. After the last attempt, nothing of the cache is left in ``/dev/shm``
(nor in ``--disk-dir``, the disk tier's directory, when one is given).

Run it::

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/torchrun_restart.py --fail kill
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from ignite.engine import Engine, Events, create_supervised_trainer
from torch import nn
from torch.utils.data import Dataset

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset, CacheStatsHandler, ShardedDistributedSampler

NUM_CLASSES = 4
FEATURES = 16


class SlowDataset(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic samples that take ``load_seconds`` each to load, like files read and decoded from storage."""

    def __init__(self, size: int, load_seconds: float = 0.002) -> None:
        self.size, self.load_seconds = size, load_seconds

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.load_seconds)
        return torch.randn(FEATURES, generator=torch.Generator().manual_seed(index)), index % NUM_CLASSES


def training(local_rank: int, args: argparse.Namespace) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = idist.get_rank()
    disk = {"disk_dir": args.disk_dir, "disk_bytes": 64 << 20} if args.disk_dir else {}
    dataset = CachedDataset(SlowDataset(args.samples), scope="node", **disk)
    sampler = ShardedDistributedSampler(dataset, shard_by="node")
    loader = idist.auto_dataloader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    model = idist.auto_model(nn.Linear(FEATURES, NUM_CLASSES))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = create_supervised_trainer(model, optimizer, nn.CrossEntropyLoss(), device=idist.device())
    CacheStatsHandler(dataset, reduce="world").attach(trainer, name="cache")
    if rank == 0:
        print(f"attempt {attempt}: node cache {dataset.segment} {dataset.disk_segment or ''}", flush=True)

    @trainer.on(Events.ITERATION_STARTED)
    def fail(engine: Engine) -> None:
        if attempt == 0 and rank == 1 and engine.state.epoch == 2 and args.fail != "none":
            print(f"attempt {attempt}: rank 1 fails ({args.fail}) in epoch 2", flush=True)
            if args.fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 fails")

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Engine) -> None:
        m = engine.state.metrics
        if rank == 0:
            print(f"attempt {attempt} epoch {engine.state.epoch}: {m['cache/hits']} hits, "
                  f"{m['cache/misses']} loads from storage", flush=True)  # fmt: skip

    trainer.run(loader, max_epochs=args.epochs)
    if rank == 0:
        print(f"attempt {attempt}: done", flush=True)
    dataset.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fail", default="kill", choices=["kill", "raise", "none"], help="how rank 1 fails")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per attempt (default 2)")
    parser.add_argument("--samples", type=int, default=256, help="dataset size (default 256)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size (default 32)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank (default 0)")
    parser.add_argument("--disk-dir", default=None, help="a node-local directory for a disk tier (default: none)")
    args = parser.parse_args()
    with idist.Parallel(backend="gloo") as parallel:  # under torchrun: the group of its workers
        parallel.run(training, args)
