"""Liveness edges of the store channel, on real gloo ranks: a rank that dies before its first block, one that dies
while leaving (after posting its outcome, before counting its exit), and a store host that stops answering."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import ignite_ext.distributed as idist
from benchmarks._store_server import StoreServer
from tests._world import World, agent_store_env

pytestmark = pytest.mark.timeout(240)

T = 3.0  # the heartbeat timeout of these worlds


def _empty_block() -> dict[str, Any]:
    """One empty one_rank_first: ok, or the dead ranks it raised about and when."""
    start = time.monotonic()
    try:
        with idist.one_rank_first():
            pass
        return {"outcome": "ok"}
    except idist.RankFailedError as exc:
        return {"outcome": "RankFailedError", "dead": list(exc.dead), "after": time.monotonic() - start}


def body_dies_before_first_block(victim: int, after: float) -> dict[str, Any]:
    if idist.get_rank() == victim:
        time.sleep(after)  # past the process group's start: the rank beats, though it never used a scheduler
        os.kill(os.getpid(), signal.SIGKILL)
    return _empty_block()


def test_a_rank_dead_before_its_first_block_is_declared_at_the_entry(world: World) -> None:
    after = 1.5
    results = world.results(body_dies_before_first_block, 2, after, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(T)})
    assert results[2].killed
    for r in results[:2] + results[3:]:
        assert r.ok and r.value["outcome"] == "RankFailedError", str(r)
        assert r.value["dead"] == [2], r.value
        assert r.value["after"] < after + 1.5 * T + 1.0, r.value


def body_dies_while_leaving(victim: int) -> dict[str, Any]:
    from ignite_ext.distributed._store_channel import StoreChannel

    with idist.one_rank_first():
        pass  # every rank beats
    if idist.get_rank() == victim:
        # SIGKILL at the one point in between: outcome posted, exit not counted yet.
        def die(self: StoreChannel, own: list[Any]) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        StoreChannel._record_exit = die  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        with idist.one_rank_first() as first:
            if first:
                time.sleep(0.5)
        return {"outcome": "ok"}
    except idist.RankFailedError as exc:
        failures = [(f.rank, f.died, f.message) for f in exc.failures]
        return {"outcome": "RankFailedError", "failures": failures, "after": time.monotonic() - start}


@pytest.mark.parametrize("victim", [0, 2], ids=["first-rank", "other-rank"])
def test_a_rank_dead_after_posting_its_outcome_is_declared(world: World, victim: int) -> None:
    # The store is not in the victim's process (TORCHELASTIC_USE_AGENT_STORE: as under torchrun), or rank 0's
    # death would take it along.
    with StoreServer() as server:
        port = server.port
        env = agent_store_env(port, T)
        results = world.results(body_dies_while_leaving, victim, env=env, deadline=90)
    assert results[victim].killed
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok and r.value["outcome"] == "RankFailedError", str(r)
        assert [f[:2] for f in r.value["failures"]] == [(victim, True)], r.value
        assert "after it finished its block" in r.value["failures"][0][2], r.value
        assert r.value["after"] < 0.5 + 1.5 * T + 1.5, (r.rank, [x.value for x in results])


def body_dies_after_posting_the_verdict() -> dict[str, Any]:
    from ignite_ext.distributed._channel_choice import scheduler_store
    from ignite_ext.distributed._state import group_state
    from ignite_ext.distributed._store_channel import StoreChannel
    from ignite_ext.distributed.store.keys import BlockKeys

    with idist.one_rank_first():
        pass  # every rank beats
    if idist.get_rank() == 0:
        # The last rank to enter judges: rank 0 comes last, and dies at the one point in between: verdict posted,
        # nobody woken yet.
        def die(self: StoreChannel, phase: str) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        StoreChannel._wake_all = die  # type: ignore[method-assign]
        store = scheduler_store()
        entered = BlockKeys(group_state(store)._next).entered
        while store is not None and int(store.add(entered, 0)) < idist.get_world_size() - 1:
            time.sleep(0.01)  # until every other rank has entered the next block
    return _empty_block()


def test_rank_0_dead_after_posting_the_verdict_is_declared_in_the_plan(world: World) -> None:
    # Rank 0's death is posted while the others still wait at the entry, but a verdict is posted: they read it
    # and declare rank 0 in the plan's wait for its outcome, waking the ranks that wait for that outcome.
    with StoreServer() as server:
        port = server.port
        env = agent_store_env(port, T)
        results = world.results(body_dies_after_posting_the_verdict, env=env, deadline=90)
    assert results[0].killed
    for r in results[1:]:
        assert r.ok and r.value["outcome"] == "RankFailedError", str(r)
        assert r.value["dead"] == [0], r.value
        assert r.value["after"] < 1.5 * T + 1.5, (r.rank, [x.value for x in results])


def body_store_paused(flag: str, timeout: float | None, work: float) -> dict[str, Any]:
    with idist.one_rank_first():
        pass
    start = time.monotonic()
    try:
        with idist.one_rank_first(timeout=timeout) as first:
            if first:
                Path(flag).touch()  # the test now stops the store host
                time.sleep(work)
        return {"outcome": "ok"}
    except (idist.StoreLostError, TimeoutError, idist.RankFailedError) as exc:
        return {"outcome": type(exc).__name__, "message": str(exc), "after": time.monotonic() - start}


def _pause_store_inside_the_block(
    world: World, flag: Path, timeout: float | None, work: float, heartbeat_timeout: float
) -> list[Any]:
    with StoreServer() as server:
        port = server.port

        def stop_when_inside(procs: list[Any]) -> None:
            def watch() -> None:
                while not flag.exists():
                    time.sleep(0.02)
                assert server.proc is not None
                server.proc.send_signal(signal.SIGSTOP)

            import threading

            threading.Thread(target=watch, daemon=True).start()

        env = agent_store_env(port, heartbeat_timeout)
        return world.results(
            body_store_paused, str(flag), timeout, work, env=env, deadline=90, on_start=stop_when_inside
        )


def test_a_paused_store_host_is_reported_within_the_timeout(world: World, tmp_path: Path) -> None:
    timeout, work = 3.0, 5.0
    results = _pause_store_inside_the_block(world, tmp_path / "inside", timeout, work, heartbeat_timeout=5.0)
    for r in results:
        assert r.ok and r.value["outcome"] == "StoreLostError", str(r)
        assert "paused or unreachable" in r.value["message"], r.value
    # The waiting ranks give up when their timeout ends (plus the store call's second), not at the store's own
    # timeout; the first rank when it tries to post its outcome after its work.
    assert all(r.value["after"] < timeout + 2.5 for r in results[1:]), [r.value for r in results]
    assert results[0].value["after"] < work + 3.0, results[0].value


def test_a_paused_store_host_is_reported_within_a_heartbeat_timeout_without_timeout(
    world: World, tmp_path: Path
) -> None:
    # A wait's slices are as long as the log interval (30 s): the heartbeat thread's beats, armed while a rank
    # waits, find the silent store within T of a beat (one every T/6), and the waiters' requests fail with them.
    work = 8.0
    results = _pause_store_inside_the_block(world, tmp_path / "inside", None, work, heartbeat_timeout=T)
    for r in results:
        assert r.ok and r.value["outcome"] == "StoreLostError", str(r)
        assert "paused or unreachable" in r.value["message"], r.value
    assert all(r.value["after"] < T * 7 / 6 + 2.0 for r in results[1:]), [r.value for r in results]
    assert results[0].value["after"] < work + T + 2.0, results[0].value
