"""One simulated host of the end-to-end demo: ``python -m tests.hosts._demo_node CONFIG NNODES NODE MASTER_ADDR PORT``.

It runs what ``python -m ignite_ext demo`` runs on each node (:func:`ignite_ext.demo._train.training` on every rank,
started by ``idist.Parallel``), with the master on host 0's address: the demo's own node launcher puts it on
127.0.0.1, where all its nodes are.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ignite_ext.distributed as idist
from ignite_ext.demo._train import DemoConfig, training

__all__ = ["PER_HOST", "main"]

PER_HOST = 2


def main(argv: list[str]) -> None:
    config, nnodes, node_rank, master_addr, master_port = argv
    raw = json.loads(Path(config).read_text())
    cfg = DemoConfig(**{**raw, "node_roots": tuple(raw["node_roots"])})
    with idist.Parallel(
        backend="gloo",
        nproc_per_node=PER_HOST,
        nnodes=int(nnodes),
        node_rank=int(node_rank),
        master_addr=master_addr,
        master_port=int(master_port),
    ) as parallel:
        parallel.run(training, cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
