"""Waiting across backends: where the native backends and the collective ones (Horovod, XLA) differ.

On native backends (gloo, NCCL) waits go through the process group's store: they outlast the collective
timeout, obey ``timeout=`` and notice a rank that died (its heartbeat stops). On Horovod and XLA waits are
collectives: see docs/backends.rst for what that changes; these tests pin the observed behaviour down.
"""

from __future__ import annotations

import pytest

from tests._world import BACKENDS, RankResult, World
from tests.backends import _bodies

pytestmark = [pytest.mark.timeout(300), pytest.mark.parametrize("world", BACKENDS, indirect=True)]


def test_first_rank_works_longer_than_the_collective_timeout(world: World) -> None:
    # Native: a process group timeout of 5 s, a first rank working 8 s. Horovod: its Gloo timeout also bounds the
    # start-up rendezvous, which a few seconds can miss on a busy machine, so 12 s and a first rank of 15 s.
    seconds, gloo_timeout = (15.0, "12") if world.name == "horovod" else (8.0, "5")
    if world.nprocs == 1:
        seconds = 1.0  # nobody waits: only the path itself is checked
    seen = world(
        _bodies.long_first_rank, seconds, None, pg_timeout=5.0, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": gloo_timeout}
    )
    assert [s["outcome"] for s in seen] == ["ok"] * world.nprocs
    assert [s["sum"] for s in seen] == [world.nprocs] * world.nprocs, "the world is unusable after the wait"
    assert all(s["waited"] >= seconds - 0.5 for s in seen), [s["waited"] for s in seen]


def test_timeout_argument(world: World) -> None:
    seen = world(_bodies.long_first_rank, 3.0, 1.0)
    if world.nprocs == 1:
        assert seen[0]["outcome"] == "ok"
    elif world.collective:
        # Not enforced: waiting ranks are inside a collective, which cannot be abandoned.
        assert [s["outcome"] for s in seen] == ["ok"] * world.nprocs
        assert all(s["waited"] >= 2.5 for s in seen[1:]), [s["waited"] for s in seen]
    else:
        assert [s["outcome"] for s in seen] == ["RankFailedError"] + ["TimeoutError"] * (world.nprocs - 1)
        assert not any(s["ran"] for s in seen[1:])
        assert all(s["waited"] < 2.9 for s in seen[1:]), [s["waited"] for s in seen]


def test_first_rank_killed(world: World) -> None:
    if world.nprocs < 2:
        pytest.skip("needs a second rank to kill")
    # The heartbeat setting only matters on native backends; elsewhere the shared world serves (and is discarded).
    env = {} if world.collective else {"IGNITE_EXT_HEARTBEAT_TIMEOUT": "5"}
    results = world.results(_bodies.killed, 1, env=env)
    assert not results[1].ok and results[1].exc_type is None, "the killed rank cannot have reported"
    others = [r for r in results if r.rank != 1]
    if world.name == "horovod":
        # Horovod's launcher ends the others as soon as a rank dies, and rank 1's keeper (up since the shared
        # world's first job) posts the death within a fraction of a second: each survivor either reported the
        # death or was ended by the launcher first, an error either way, never a hang nor a run block.
        assert not any(r.timed_out for r in others), "\n".join(str(r) for r in others)
        reported = [r for r in others if r.ok]
        assert all(not r.value["ran"] for r in reported), "\n".join(str(r) for r in reported)
        _assert_declared_dead(reported, "its process was killed or crashed")
        return
    # A fresh world: rank 1 dies before its keeper may be up, and then only its silence tells.
    _assert_declared_dead(others, "its process was killed or crashed", "no heartbeat")


def test_hung_rank_declared_dead(world: World) -> None:
    if world.nprocs < 2:
        pytest.skip("needs a second rank to stop")
    if world.collective:
        pytest.skip("the collective channel notices only what the backend notices: a stopped rank is a hang")
    # Rank 1 stops (SIGSTOP: a hung process, which no launcher notices) inside its block and is killed 14 s later.
    t = 5.0
    results = world.results(_bodies.stopped, 1, 14.0, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)})
    assert not results[1].ok and results[1].exc_type is None, "the stopped rank cannot have reported"
    others = [r for r in results if r.rank != 1]
    _assert_declared_dead(others, "no heartbeat")
    # 4/3 T to report it (the detector's bound), the fault sweep's slack for a loaded two-core machine (T/2 + 1 s),
    # and a second for rank 1 to stop after the entry; still well before the SIGKILL at 14 s, which its keeper
    # would report as a death instead of a silence.
    bound = 4 / 3 * t + t / 2 + 2.0
    waited = [round(r.value["left"] - r.value["entered"], 2) for r in others]
    assert all(w < bound for w in waited), (waited, bound)


def _assert_declared_dead(others: list[RankResult], *how: str) -> None:
    """Every rank of ``others`` reported ``RankFailedError`` for rank 1's death, found in one of the ways ``how``."""
    assert all(r.ok for r in others), "\n".join(str(r) for r in others)
    for r in others:
        assert r.value["outcome"] == "RankFailedError" and not r.value["ran"], r.value
        assert r.value["failures"] and r.value["failures"][0][:2] == (1, "RankDiedError"), r.value
        assert any(h in r.value["message"] for h in how), r.value
