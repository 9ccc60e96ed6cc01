"""One rank of the Slurm launch-form tests, under ``ignite_ext.distributed`` or plain ``ignite.distributed``.

``python -m tests.slurm._body MODULE FOLDER`` forms the group with ``idist.Parallel(backend="gloo")`` (Slurm's or
torchrun's variables, as launched), then:

1. downloads once per node into ``FOLDER`` inside ``one_rank_first(local=True)`` (each download appends a line to
   ``FOLDER/downloads``);
2. runs a block inside ``one_rank_first()`` where rank 0 raises: every other rank prints what it raised.

Each rank prints ``formed RANK WORLD LOCAL_RANK``, ``downloads N`` and ``rank R raised TYPE: MESSAGE``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _say(line: str) -> None:
    # One write per line: the ranks share srun's pipe, and print() may write a line and its newline apart.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _body(local_rank: int, idist: Any, folder: Path) -> None:
    rank = idist.get_rank()
    _say(f"formed {rank} {idist.get_world_size()} {local_rank}")
    folder.mkdir(parents=True, exist_ok=True)  # a node's own /tmp, on the two-node bed
    with idist.one_rank_first(local=True):
        target = folder / "data.bin"
        if not target.exists():
            with open(folder / "downloads", "a") as log:
                log.write(f"{rank}\n")
            target.write_bytes(b"samples")
    idist.barrier()
    _say(f"downloads {len((folder / 'downloads').read_text().split())}")
    try:
        with idist.one_rank_first():
            if rank == 0:
                raise ValueError("rank 0 cannot read its shard")
    except Exception as exc:
        _say(f"rank {rank} raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        raise


def main(argv: list[str]) -> None:
    idist = importlib.import_module(argv[0])
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(_body, idist, Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
