"""Run by torchrun in the two-node tests: each scheduling scenario once, results as JSON per rank.

Usage: torchrun ... torchrun_body.py NODE_LOCAL_DIR SHARED_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import ignite_ext.distributed as idist


def scenario(make_cm: Any, probe: Path | None = None) -> dict[str, Any]:
    with make_cm() as turn:
        seen: dict[str, Any] = {"first": bool(turn), "leader": turn.leader, "group": list(turn.group)}
        seen["start"] = time.monotonic()
        if probe is not None:
            # Leaders create the file; the others must find it: proof that they share the leader's directory.
            if turn:
                probe.write_text(str(idist.get_rank()))
            seen["probe"] = probe.read_text() if probe.exists() else None
        time.sleep(0.4 if turn else 0.1)
        seen["end"] = time.monotonic()
    return seen


def scenarios(local_dir: Path, shared_dir: Path) -> dict[str, dict[str, Any]]:
    """Each node-aware scheduling scenario once: local rank 0 first, Ordered per node, SharedPath on both dirs."""
    return {
        "master_local": scenario(lambda: idist.one_rank_first(local=True)),
        "ordered_local": scenario(lambda: idist.rank_scheduler(order=idist.Ordered(local=True))),
        "shared_local": scenario(
            lambda: idist.rank_scheduler(order=idist.SharedPath(local_dir / "data")), local_dir / "data" / "probe"
        ),
        "shared_all": scenario(
            lambda: idist.rank_scheduler(order=idist.SharedPath(shared_dir / "data")), shared_dir / "data" / "probe"
        ),
    }


def main() -> None:
    node_local, shared, out = (Path(a) for a in sys.argv[1:4])
    idist.initialize("gloo")
    rank = idist.get_rank()
    result = {
        "rank": rank,
        "node": idist.get_node_rank(),
        "local_rank": idist.get_local_rank(),
        **scenarios(node_local, shared),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    idist.finalize()


if __name__ == "__main__":
    main()
