"""Readable per-rank output: every rank prints a multi-line report, one rank at a time.

Four gloo ranks (``idist.Parallel``) each print a report of several lines. Inside
``idist.rank_scheduler(order=idist.Ordered())`` rank 0 prints its whole report, then rank 1, and so on, so the
reports come out in rank order and unbroken; with ``--unordered`` the same reports interleave. ``--local`` uses
``Ordered(local=True)``: the order holds within each node and the nodes print side by side (on one machine, as
here, that is the same as ``Ordered()``).

Run it::

    python examples/ordered_printing.py            # 4 ranks, reports in rank order
    python examples/ordered_printing.py --unordered
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time

import torch

import ignite_ext.distributed as idist


def report(local_rank: int, mode: str) -> None:
    rank = idist.get_rank()
    # A collective outside the scheduled block: every rank must take part in it.
    total = idist.all_reduce(torch.tensor([rank]))
    lines = [
        f"[rank {rank}/{idist.get_world_size()}] report begins",
        f"  node {idist.get_node_rank()}, local rank {local_rank}, pid {os.getpid()}",
        f"  backend {idist.backend()}, device {idist.device()}",
        f"  sum of all ranks (all_reduce): {int(total.item())}",
        f"[rank {rank}] report ends",
    ]
    if mode == "unordered":
        order: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    else:
        order = idist.rank_scheduler(order=idist.Ordered(local=mode == "local"))
    with order:
        for line in lines:  # several writes: without the scheduler, other ranks' lines get in between
            print(line, flush=True)
            time.sleep(0.02)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="number of ranks (default 4)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--local", action="store_true", help="Ordered(local=True): rank order within each node")
    group.add_argument("--unordered", action="store_true", help="no scheduler: the reports interleave")
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork"], help="fork: faster, CPU only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)
    mode = "local" if args.local else "unordered" if args.unordered else "world"
    with idist.Parallel(backend="gloo", nproc_per_node=args.nproc, start_method=args.start_method) as parallel:
        parallel.run(report, mode)
