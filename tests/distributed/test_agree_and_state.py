"""The one agreement helper, the scheduler's per-group state, and the one way to the default store."""

from __future__ import annotations

import inspect
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import distributed_c10d

import ignite_ext.distributed as idist
from ignite_ext.distributed._state import GroupState
from ignite_ext.distributed.agreement import disagreement
from ignite_ext.distributed.policies import Plan, Policy, Turn, World
from ignite_ext.distributed.store.clients import default_store
from ignite_ext.distributed.store.keys import BlockKeys, heartbeat_key
from ignite_ext.errors import ShmSpaceError
from tests._world import World as ProcessWorld

pytestmark = pytest.mark.timeout(240)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        return {"ok": fn(*args, **kwargs)}
    except Exception as exc:
        cause = exc.__cause__
        return {"type": type(exc).__name__, "message": str(exc), "cause": type(cause).__name__ if cause else None}


def body_agree() -> dict[str, Any]:
    rank = idist.get_rank()

    def fails_on_2(kind: type[Exception]) -> int:
        if rank == 2:
            raise kind("bad on rank 2")
        return rank * 10

    return {
        "values": _outcome(idist.agree, lambda: rank * 10, "collecting"),
        "value_error": _outcome(idist.agree, lambda: fails_on_2(ValueError), "checking the input"),
        "os_error": _outcome(idist.agree, lambda: fails_on_2(PermissionError), "opening the directory"),
        "other": _outcome(idist.agree, lambda: fails_on_2(KeyError), "looking up"),
        "kept": _outcome(idist.agree, lambda: fails_on_2(ShmSpaceError), "creating the cache"),
        "unprintable": _outcome(idist.agree, lambda: fails_on_2(_Unprintable), "running the step"),
        "disagree": _outcome(
            idist.agree,
            lambda: "a" if rank != 1 else "b",
            "comparing the settings",
            check=disagreement,
        ),
        "combined": _outcome(idist.agree, lambda: rank, "summing", combine=sum),
        "after": _outcome(idist.agree, lambda: rank, "after the failures"),  # every rank still in step
    }


@pytest.mark.distributed
def test_agree_raises_the_same_error_on_every_rank(world: ProcessWorld) -> None:
    seen = world(body_agree)
    for rank, s in enumerate(seen):
        assert s["values"] == {"ok": [0, 10, 20, 30]}
        assert s["value_error"]["type"] == "ValueError"
        assert (
            "checking the input failed on rank(s) [2]: rank 2: ValueError: bad on rank 2" in s["value_error"]["message"]
        )
        assert s["os_error"]["type"] == "ValueError" and "PermissionError: bad on rank 2" in s["os_error"]["message"]
        assert s["other"]["type"] == "RuntimeError" and "KeyError" in s["other"]["message"]
        assert s["kept"]["type"] == "ShmSpaceError"
        assert s["unprintable"]["type"] == "RuntimeError" and "_Unprintable" in s["unprintable"]["message"]
        assert s["disagree"]["type"] == "ValueError"
        assert "ranks [0, 2, 3]: a; ranks [1]: b" in s["disagree"]["message"]
        assert s["combined"] == {"ok": 6} and s["after"] == {"ok": [0, 1, 2, 3]}
        # The failing rank's error is chained to its own exception; the others have nothing to chain.
        assert s["value_error"]["cause"] == ("ValueError" if rank == 2 else None)


class _Together(Policy):
    """Every rank runs at once (so that all are inside the block together)."""

    def plan(self, world: World, comm: Any) -> Plan:
        everyone = tuple(range(world.world_size))
        return Plan(tuple(Turn(r, True, frozenset(), everyone, 0) for r in everyone))


def body_thread_inside_a_block(shared: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def in_thread() -> None:
        try:
            with idist.one_rank_first() as first:
                seen["start"] = time.monotonic()
                if first:
                    time.sleep(0.5)
                seen["end"] = time.monotonic()
            with idist.rank_scheduler(order=idist.SharedPath(shared)) as turn:
                seen["shared_path_leader"] = bool(turn)
            time.sleep(0.5)  # heartbeats run deferred key deletions meanwhile: the outer block's keys must survive
            seen["outcome"] = "ok"
        except Exception as exc:
            seen["outcome"] = f"{type(exc).__name__}: {exc}"

    with idist.rank_scheduler(order=_Together()):
        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join(60)
    return seen


@pytest.mark.distributed
def test_a_thread_entering_a_scheduler_inside_a_block_runs_a_block_of_its_own(
    world: ProcessWorld, tmp_path: Path
) -> None:
    # Fast heartbeats (every 0.1 s), so that deleting a block's keys too early would show within the test.
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": "0.6"}
    seen = world(body_thread_inside_a_block, str(tmp_path), env=env, deadline=60)
    assert [s["outcome"] for s in seen] == ["ok"] * 4, seen
    # Not nested: the others really waited for rank 0's thread, and SharedPath (which refuses nesting) ran.
    assert all(s["start"] >= seen[0]["end"] for s in seen[1:]), seen
    assert [s["shared_path_leader"] for s in seen] == [True, False, False, False]


def body_overlapping_blocks() -> dict[str, Any]:
    outcome: dict[str, Any] = {}

    def in_thread() -> None:
        time.sleep(0.5)  # the main thread has taken block 0 by then, on every rank
        try:
            with idist.rank_scheduler(order=_Together()):
                pass
            outcome["thread"] = "ok"
        except Exception as exc:
            outcome["thread"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=in_thread)
    thread.start()
    try:
        with idist.one_rank_first() as first:
            if not first:
                time.sleep(1.5)  # rank 0 has posted its exit; the thread's block comes and goes meanwhile
        outcome["main"] = "ok"
    except Exception as exc:
        outcome["main"] = f"{type(exc).__name__}: {exc}"
    thread.join(30)
    return outcome


@pytest.mark.distributed
def test_keys_of_a_block_still_in_progress_survive_a_later_block_of_another_thread(world: ProcessWorld) -> None:
    # Block 1 (threads) starts and ends while block 0 (main threads) is in progress: entering block 1 does not
    # prove that block 0 is over, so block 0's keys (its exit counter) must not be deleted at block 1's verdict.
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": "0.6"}  # deferred deletions run every 0.1 s
    seen = world(body_overlapping_blocks, env=env, deadline=45)
    assert seen == [{"thread": "ok", "main": "ok"}] * 4


def test_a_thread_is_not_nested_in_the_main_threads_block() -> None:
    result: dict[str, Any] = {}

    def in_thread() -> None:
        try:
            with tempfile.TemporaryDirectory() as tmp, idist.rank_scheduler(order=idist.SharedPath(tmp)) as turn:
                result["turn"] = bool(turn)
        except Exception as exc:
            result["error"] = repr(exc)

    with idist.one_rank_first():
        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join(30)
    assert result == {"turn": True}


def test_sequence_numbers_are_taken_once_across_threads() -> None:
    state = GroupState()
    taken: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(2000):
            seq = state.take_sequence()
            with lock:
                taken.append(seq)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(taken) == list(range(16000))


def test_the_private_torch_api_behind_default_store_is_still_there() -> None:
    # default_store() is the one user of torch's private _get_default_store: fail loudly if torch changes it.
    fn = distributed_c10d._get_default_store
    assert not [p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
    assert default_store() is None  # no process group here


def body_default_store() -> dict[str, Any]:
    store = default_store()
    assert isinstance(store, torch.distributed.Store)
    assert store is distributed_c10d._get_default_store()
    store.set(f"probe/{idist.get_rank()}", "x")
    idist.barrier()
    return {"seen": [store.check([f"probe/{r}"]) for r in range(idist.get_world_size())]}


@pytest.mark.distributed
def test_default_store_is_the_process_groups_store(world: ProcessWorld) -> None:
    assert [s["seen"] for s in world(body_default_store, nprocs=2)] == [[True, True]] * 2


def test_every_store_key_lives_under_one_root_and_is_deleted_by_someone() -> None:
    keys = BlockKeys(3)
    kinds = [keys.entry(0), keys.entered, keys.verdict, keys.outcome(0), keys.exits, keys.nfail, keys.acks]
    assert all(k.startswith("ignite_ext/sched/3/") for k in [*kinds, keys.fail(1)])
    deleted = set(keys.deleted_by(0)) | set(keys.deleted_by(1))
    assert set(kinds) <= deleted and keys.outcome(1) in deleted and keys.entry(1) in deleted
    assert heartbeat_key(5) == "ignite_ext/hb/5"
