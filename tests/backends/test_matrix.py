"""The backend matrix: the same bodies (``tests/backends/_bodies.py``) on every backend of the ``world`` fixture.

Backends: serial; gloo with 4 ranks; gloo over two simulated nodes of 2 ranks; Horovod (Gloo controller, 4 ranks,
skipped when horovod is not installed or its build failed); XLA on one CPU device (skipped without torch_xla,
see ``scripts/xla_tests.sh``); NCCL (skipped without GPUs, see ``scripts/nccl_check.sh``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests._world import BACKENDS, World
from tests.backends import _bodies

pytestmark = [pytest.mark.timeout(300), pytest.mark.parametrize("world", BACKENDS, indirect=True)]


def test_world_runs_on_its_backend(world: World) -> None:
    seen = world(_bodies.identity)
    n, npn = world.nprocs, world.nproc_per_node
    assert [s["backend"] for s in seen] == [world.backend] * n
    assert [(s["rank"], s["world_size"]) for s in seen] == [(r, n) for r in range(n)]
    assert [(s["local_rank"], s["node_rank"], s["nnodes"]) for s in seen] == [
        (r % npn, r // npn, n // npn) for r in range(n)
    ]


def test_master_first_order_and_flag(world: World, tmp_path: Path) -> None:
    n = world.nprocs
    seen = world(_bodies.master_first, str(tmp_path), [(0, False), (n - 1, False)])
    assert [[turn["first"] for turn in s] for s in seen] == [[r == 0, r == n - 1] for r in range(n)]


def test_master_first_local_per_node(world: World, tmp_path: Path) -> None:
    seen = [turns[0] for turns in world(_bodies.master_first, str(tmp_path), [(0, True)])]
    npn = world.nproc_per_node
    assert [s["first"] for s in seen] == [r % npn == 0 for r in range(world.nprocs)]
    assert [s["node"] for s in seen] == [r // npn for r in range(world.nprocs)]


def test_ordered_runs_ranks_in_rank_order(world: World, tmp_path: Path) -> None:
    seen = world(_bodies.ordered, str(tmp_path))
    assert [s["events"] for s in seen] == [2 * world.nprocs] * world.nprocs


def test_first_rank_failure_raises_rank_failed_error_on_the_others(world: World) -> None:
    seen = world(_bodies.fail, "master", 0)
    assert [s["outcome"] for s in seen] == ["OSError"] + ["RankFailedError"] * (world.nprocs - 1)
    assert [s["ran"] for s in seen] == [True] + [False] * (world.nprocs - 1)
    assert "disk full on rank 0" in seen[0]["message"], "the failing rank must get its own error back"
    for s in seen[1:]:
        assert s["ranks"] == [0], s
        assert s["failures"] == [(0, "OSError", "disk full on rank 0")], s
    # The world is still usable afterwards: nothing was left half-way through a collective.
    assert [s["sum"] for s in seen] == [world.nprocs] * world.nprocs


def test_download_url_inside_one_rank_first(world: World, tmp_path: Path) -> None:
    payload = os.urandom(256 * 1024)
    src = tmp_path / "src" / "payload.bin"
    src.parent.mkdir()
    src.write_bytes(payload)
    workdir = tmp_path / "shared"
    workdir.mkdir()
    seen = world(_bodies.download_in_one_rank_first, str(workdir), src.as_uri(), hashlib.sha256(payload).hexdigest())
    assert [s["first"] for s in seen] == [True] + [False] * (world.nprocs - 1)
    assert [s["existed"] for s in seen] == [False] + [True] * (world.nprocs - 1)
    assert len({s["ident"] for s in seen}) == 1, "the file was published more than once"
    assert (workdir / "data" / "payload.bin").read_bytes() == payload
    assert not [f for f in seen[-1]["files"] if f.endswith((".part", ".tmp"))], seen[-1]["files"]


def test_sampler_takes_world_from_idist(world: World) -> None:
    seen = world(_bodies.sampler_defaults, 22)
    n = world.nprocs
    assert [(s["num_replicas"], s["rank"]) for s in seen] == [(n, r) for r in range(n)]
    assert [s["node_rank"] for s in seen] == [r // world.nproc_per_node for r in range(n)]


def test_cache_stats_reduce_over_the_world(world: World) -> None:
    seen = world(_bodies.cache_stats_reduction)
    n, npn = world.nprocs, world.nproc_per_node
    assert [s["world_hits"] for s in seen] == [n * (n + 1) // 2] * n
    node_hits = [sum(q + 1 for q in range((r // npn) * npn, (r // npn + 1) * npn)) for r in range(n)]
    assert [s["node_hits"] for s in seen] == node_hits
