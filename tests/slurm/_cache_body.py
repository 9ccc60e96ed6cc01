"""One rank of the requeue tests: a node cache filled, then a wait for Slurm's ``SIGTERM``.

``srun -n 2 python -m tests.slurm._cache_body`` forms the group with ``idist.Parallel(backend="gloo")``, reads a
``CachedDataset(scope="node")`` of 64 samples once, prints ``filled RANK`` and waits (90 s at most) for the
``SIGTERM`` that ends it: Python's default action, so the cache's own handler decides what is left.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils.data import TensorDataset

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset

__all__ = ["main"]


def _body(local_rank: int) -> None:
    dataset = CachedDataset(TensorDataset(torch.arange(64.0)), scope="node")
    for index in range(len(dataset)):
        dataset[index]
    idist.barrier()
    sys.stdout.write(f"filled {idist.get_rank()}\n")
    sys.stdout.flush()
    time.sleep(90)


def main() -> None:
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(_body)


if __name__ == "__main__":
    main()
