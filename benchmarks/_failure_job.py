"""The job of the failure-cost benchmark (:mod:`benchmarks.bench_failure_cost`): one epoch, a failure, a restart.

``python -m benchmarks._failure_job MODULE CACHED LAUNCHER FOLDER N`` under torchrun or srun: two gloo ranks read
``N`` samples (a file read and a 2 ms decode each, counted in ``FOLDER/reads.ATTEMPT``), through
``CachedDataset(scope="node")`` with the package's sampler when ``CACHED`` is 1, else the plain dataset with
torch's ``DistributedSampler``. At the end of attempt 0 the job fails as ``LAUNCHER`` sees failures (torchrun:
rank 1 exits with 1; slurm: rank 0 requeues the job, as a preemption does), after writing the time in
``FOLDER/failed``. Attempt 1 writes the time of its first batch in ``FOLDER/first_batch``, then its epoch.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["Source", "main"]


class Source(Dataset[torch.Tensor]):
    """``n`` samples, each a file read and a 2 ms decode, every read counted in ``reads.ATTEMPT``.

    The same in every attempt (the attempt is read at each load): a restarted group's cache is the same cache.
    """

    def __init__(self, folder: Path, n: int) -> None:
        self.folder, self.n = folder, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.folder / f"reads.{_attempt()}", "a") as reads:
            reads.write("x")  # one byte a read (appends of one process never interleave)
        time.sleep(0.002)
        return torch.full((16,), float(index))


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or 0)


def _stamp(path: Path) -> None:
    path.write_text(f"{time.time():.6f}")


def _training(local_rank: int, idist: Any, cached: bool, launcher: str, folder: Path, n: int) -> None:
    attempt, rank = _attempt(), idist.get_rank()
    source = Source(folder, n)
    if cached:
        from ignite_ext.data import CachedDataset, ShardedDistributedSampler

        dataset: Any = CachedDataset(source, scope="node")
        sampler: Any = ShardedDistributedSampler(dataset)
    else:
        dataset, sampler = source, DistributedSampler(source)
    for index, _ in enumerate(DataLoader(dataset, batch_size=16, sampler=sampler)):
        if attempt == 1 and index == 0 and rank == 0:
            _stamp(folder / "first_batch")
    if attempt > 0:
        return
    idist.barrier()
    if launcher == "torchrun" and rank == 1:
        _stamp(folder / "failed")
        os._exit(1)  # torchrun stops the other rank and restarts both
    if launcher == "slurm" and rank == 0:
        _stamp(folder / "failed")
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
    time.sleep(120)  # the launcher ends this attempt here


def main(argv: list[str]) -> None:
    module, cached, launcher, folder, n = argv
    idist = importlib.import_module(module)
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(_training, idist, cached == "1", launcher, Path(folder), int(n))


if __name__ == "__main__":
    main(sys.argv[1:])
