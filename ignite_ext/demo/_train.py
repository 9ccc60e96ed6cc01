"""What every rank of the demo runs: fetch once per node directory, then train on the cached, sharded set."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events, create_supervised_evaluator, create_supervised_trainer
from ignite.metrics import Accuracy
from torch import nn

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset, CacheStatsHandler, ShardedDistributedSampler, download_for_job
from ignite_ext.demo.data import NUM_CLASSES, ShapesDataset, random_flip

__all__ = ["DemoConfig", "training"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything a rank needs; travels to the ranks by pickling.

    Args:
        url: the dataset archive.
        sha256: its expected digest (None: not verified).
        node_roots: one data directory per node (node-local in the demo, so each node fetches once).
        out: where rank 0 writes the results as JSON.
        epochs: training epochs.
        batch_size: global batch size (split over the ranks by ``idist.auto_dataloader``).
        workers: DataLoader workers per rank.
        progress: show the download's progress bar.

    .. versionadded:: 0.1.0
    """

    url: str
    sha256: str | None
    node_roots: tuple[str, ...]
    out: str
    epochs: int = 3
    batch_size: int = 128
    workers: int = 1
    progress: bool = True


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, NUM_CLASSES),
    )


def _fetch(cfg: DemoConfig) -> tuple[Path, float]:
    root = Path(cfg.node_roots[idist.get_node_rank() % len(cfg.node_roots)])
    start = time.perf_counter()
    # One rank per node directory makes its copy, the archive coming from the server once for the whole job and
    # relayed node to node; the others find their directory's verified, extracted copy.
    data = download_for_job(cfg.url, root, sha256=cfg.sha256, extract=True, progress=cfg.progress)
    return data, time.perf_counter() - start


def _say(what: str) -> None:
    """One line of the demo's progress, from rank 0 only (the others would repeat it)."""
    if idist.get_rank() == 0:
        print(f"[demo] {what}", flush=True)


def _record_epochs(trainer: Engine, history: list[dict[str, float]]) -> None:
    started: list[float] = []

    @trainer.on(Events.EPOCH_STARTED)
    def _start(engine: Engine) -> None:
        started.append(time.perf_counter())

    @trainer.on(Events.EPOCH_COMPLETED)
    def _end(engine: Engine) -> None:
        metrics = engine.state.metrics
        history.append(
            {
                "epoch": engine.state.epoch,
                "seconds": time.perf_counter() - started[-1],
                "hit_rate": float(metrics["cache/hit_rate"]),
                "storage_reads": float(metrics["cache/misses"]),
                "loss": float(engine.state.output),  # type: ignore[arg-type]
            }
        )
        _say(f"epoch {engine.state.epoch} done in {history[-1]['seconds']:.2f} s")


def training(local_rank: int, cfg: DemoConfig) -> None:
    """Run on every rank (under ``idist.Parallel``): fetch, cache, shard, train, report.

    .. versionadded:: 0.1.0
    """
    torch.manual_seed(0)
    rank, node = idist.get_rank(), idist.get_node_rank()
    _say(f"process group up ({idist.get_world_size()} gloo ranks); fetching the archive once for the job")
    data, fetch_seconds = _fetch(cfg)

    # Decoded images are cached; the random flip runs in the DataLoader workers on every read.
    train_set = CachedDataset(ShapesDataset(data, "train"), scope="node", transform=random_flip)
    sampler = ShardedDistributedSampler(train_set, shard_by="node")
    loader = idist.auto_dataloader(
        train_set,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.workers,
        persistent_workers=cfg.workers > 0,
        # Ranks started by idist.Parallel inherit its "spawn" start method, so each worker would import torch
        # again; fork (what workers use under torchrun) starts them at once. The cache works with either.
        multiprocessing_context="fork" if cfg.workers > 0 else None,
    )
    val_set = ShapesDataset(data, "val")
    val_loader = idist.auto_dataloader(
        val_set, batch_size=cfg.batch_size, sampler=ShardedDistributedSampler(val_set, shuffle=False), num_workers=0
    )

    model = idist.auto_model(_model())
    optimizer = idist.auto_optim(torch.optim.Adam(model.parameters(), lr=1e-2))
    trainer = create_supervised_trainer(model, optimizer, nn.CrossEntropyLoss())
    CacheStatsHandler(train_set, reduce="world").attach(trainer, name="cache")
    history: list[dict[str, float]] = []
    _record_epochs(trainer, history)
    _say(f"data ready on every node; training {cfg.epochs} epochs (the first fills the node caches)")
    trainer.run(loader, max_epochs=cfg.epochs)

    evaluator = create_supervised_evaluator(model, metrics={"accuracy": Accuracy()})
    accuracy = float(evaluator.run(val_loader).metrics["accuracy"])
    own = train_set.stats()

    rates = " ".join(f"{h['hit_rate']:.0%}" for h in history)
    with idist.rank_scheduler(order=idist.Ordered()):
        print(
            f"[rank {rank} | node {node}] data ready in {fetch_seconds:.2f} s  "
            f"shard: {len(sampler)} samples  samples read by this rank: {own.hits + own.misses} "
            f"({own.hits} from the cache, {own.misses} from storage; {own.entries} stored)  "
            f"hit rate by epoch: {rates}",
            flush=True,
        )
    if rank == 0:
        result: dict[str, Any] = {
            "history": history,
            "accuracy": accuracy,
            "world_size": idist.get_world_size(),
            "nnodes": idist.get_nnodes(),
            "train_samples": len(train_set),
        }
        Path(cfg.out).write_text(json.dumps(result))
    train_set.close()
