"""Rank scheduler behaviour over real gloo ranks (store and collective channels) and in serial mode.

Each body runs on every rank and returns what that rank observed (``tests.backends._bodies.observe``), so one
test checks the same body in serial mode, over 4 gloo ranks with the store channel, and with the collective one
(``world`` parametrised with ``tests._world.CHANNELS``). The bodies shared with the backend matrix live in
``tests/backends/_bodies.py``; the ones only this module uses are below.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ignite.distributed as ignite_idist
import pytest
import torch

import ignite_ext.distributed as idist
from tests._world import CHANNELS, World
from tests.backends import _bodies
from tests.backends._bodies import observe

pytestmark = pytest.mark.timeout(240)

channels = pytest.mark.parametrize("world", CHANNELS, indirect=True)


# ------------------------------------------------------------------------------------------------- bodies


def body_bad_args(kind: str) -> dict[str, Any]:
    rank = idist.get_rank()
    args: dict[str, Callable[[], Any]] = {
        "out_of_range": lambda: idist.one_rank_first(rank=idist.get_world_size()),
        "negative": lambda: idist.one_rank_first(rank=-1),
        "mismatch": lambda: idist.one_rank_first(rank=0 if rank < 2 else 1),
        "wrong_type": lambda: idist.one_rank_first(rank="0" if rank == 3 else 0),  # type: ignore[arg-type]
        "not_a_policy": lambda: idist.rank_scheduler(order="ordered" if rank == 1 else idist.Ordered()),  # type: ignore[arg-type]
        "bad_timeout": lambda: idist.one_rank_first(timeout=-1.0 if rank == 2 else None),
    }
    return observe(lambda t: None, args[kind])


def body_logs(seconds: float) -> dict[str, Any]:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("ignite_ext.distributed")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    seen = observe(lambda t: time.sleep(seconds) if t else None, idist.one_rank_first)
    seen["logs"] = messages
    return seen


def body_nested() -> dict[str, Any]:
    inner: list[bool] = []

    def block(turn: Any) -> None:
        with idist.one_rank_first() as again:
            inner.append(bool(again))
        with idist.rank_scheduler(order=idist.Ordered()) as ordered:
            inner.append(bool(ordered))

    seen = observe(block, idist.one_rank_first)
    seen["inner"] = inner
    # A second, un-nested use after the nested ones must still line up across ranks.
    seen["after"] = observe(lambda t: None, idist.one_rank_first)["outcome"]
    return seen


def body_finalize_right_after() -> str:
    outcome = observe(lambda t: time.sleep(0.2) if t else None, idist.one_rank_first)["outcome"]
    # The end of a script: every rank tears the process group down at once (rank 0's process hosts the
    # store); no rank may lose its outcome to that.
    idist.finalize()
    return str(outcome)


def body_repeated(n: int) -> list[str]:
    return [observe(lambda t: None, idist.one_rank_first)["outcome"] for _ in range(n)]


def body_where_it_is_raised(order: str) -> dict[str, Any]:
    """The frames of the error this rank gets when rank 2 fails: the user's ``with`` line and one line of the
    package's, whose text says what happened (a launcher shows the innermost line)."""
    rank = idist.get_rank()
    policy = idist.Ordered() if order == "ordered" else idist.MasterFirst(2)
    try:
        with idist.rank_scheduler(order=policy):  # the user's line
            if rank == 2:
                raise OSError("disk full on rank 2")
    except OSError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
    except idist.RankFailedError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
    return {"frames": [(Path(f.filename).name, f.name, f.line) for f in frames]}


# ------------------------------------------------------------------------------------------------- tests


def test_superset_of_ignite_distributed() -> None:
    names = [n for n in dir(ignite_idist) if not n.startswith("_")]
    assert names, "ignite.distributed exposes names"
    for name in names:
        assert name in idist.__all__, name
        if name == "utils":  # ignite's names, with the failure-safe one_rank_first (tests/distributed/test_drop_in.py)
            assert idist.utils.one_rank_first is idist.one_rank_first
        elif name != "one_rank_first":
            assert getattr(idist, name) is getattr(ignite_idist, name), name
    for own in ("one_rank_first", "rank_scheduler", "MasterFirst", "Ordered", "Policy", "RankFailedError"):
        assert own in idist.__all__
    assert issubclass(idist.RankFailedError, RuntimeError)


def master_first(world: World, workdir: Path, rank: int, local: bool, **options: Any) -> list[dict[str, Any]]:
    """Every rank's report of one ``one_rank_first(rank, local)`` turn (``tests.backends._bodies.master_first``)."""
    return [turns[0] for turns in world(_bodies.master_first, str(workdir), [(rank, local)], **options)]


@channels
def test_master_first_runs_first_rank_before_the_others(world: World, tmp_path: Path) -> None:
    seen = master_first(world, tmp_path, 0, False)
    assert [s["outcome"] for s in seen] == ["ok"] * len(seen)
    assert [s["first"] for s in seen] == [True] + [False] * (len(seen) - 1)
    for s in seen[1:]:
        assert s["start"] >= seen[0]["end"], "a waiting rank started before the first rank finished"


@channels
def test_master_first_other_rank_and_local(world: World, tmp_path: Path) -> None:
    if world.serial:
        pytest.skip("needs several ranks")
    seen = master_first(world, tmp_path / "rank2", 2, False)
    assert [s["first"] for s in seen] == [False, False, True, False]
    assert all(s["start"] >= seen[2]["end"] for s in seen if s["rank"] != 2)
    # Two simulated nodes of two ranks: local rank 1 of each node goes first, nodes in parallel.
    seen = master_first(world, tmp_path / "local1", 1, True, nproc_per_node=2)
    assert [s["first"] for s in seen] == [False, True, False, True]
    assert [s["leader"] for s in seen] == [1, 1, 3, 3]
    assert seen[0]["start"] >= seen[1]["end"] and seen[2]["start"] >= seen[3]["end"]
    assert seen[3]["start"] < seen[1]["end"] and seen[1]["start"] < seen[3]["end"], "node leaders overlap"


@channels
def test_ordered_runs_ranks_one_at_a_time(world: World, tmp_path: Path) -> None:
    seen = world(_bodies.ordered, str(tmp_path), False)
    assert [s["outcome"] for s in seen] == ["ok"] * len(seen)
    for prev, nxt in itertools.pairwise(seen):
        assert nxt["start"] >= prev["end"], "ordered blocks overlapped"


@channels
def test_ordered_local_orders_within_nodes_in_parallel(world: World, tmp_path: Path) -> None:
    if world.serial:
        pytest.skip("needs several nodes")
    seen = world(_bodies.ordered, str(tmp_path), True, nproc_per_node=2)
    assert [s["first"] for s in seen] == [True, False, True, False]
    assert seen[1]["start"] >= seen[0]["end"] and seen[3]["start"] >= seen[2]["end"]
    assert seen[2]["start"] < seen[0]["end"], "nodes should run in parallel"


@channels
def test_first_rank_failure_reaches_every_waiting_rank(world: World) -> None:
    seen = world(_bodies.fail, "master", 0)
    assert seen[0]["outcome"] == "OSError" and "disk full on rank 0" in seen[0]["message"]
    for s in seen[1:]:
        assert s["outcome"] == "RankFailedError", s
        assert s["ran"] is False, "a waiting rank ran the block after the first rank failed"
        assert s["failures"] == [(0, "OSError", "disk full on rank 0")]
        assert "rank(s) [0]" in s["message"] and "OSError" in s["message"]
        # Where rank 0 failed, in its own words: waiting ranks exit first, so theirs is the traceback users see.
        assert "_bodies.py" in s["where"][0] and "in block" in s["where"][0], s["where"]
        assert 'raise OSError(f"disk full on rank {rank}")' in s["message"], s["message"]
    assert [s["sum"] for s in seen] == [len(seen)] * len(seen), "the world is unusable after the failure"


@channels
@pytest.mark.parametrize("order", ["ordered", "master"])
def test_another_ranks_failure_is_raised_from_the_users_with_line(world: World, order: str) -> None:
    # Raised on entering (the ranks that waited: ordered 3, master 0, 1, 3) or on leaving (ordered 0, 1, which ran
    # before rank 2): the traceback ends in the user's `with` line and one line of the package, never in the
    # protocol's internals (it ended in `raise RankStalledError.among(...)` for a RankFailedError).
    if world.serial:
        pytest.skip("needs several ranks")
    seen = world(body_where_it_is_raised, order)
    user = (
        "test_schedule.py",
        "body_where_it_is_raised",
        "with idist.rank_scheduler(order=policy):  # the user's line",
    )
    for rank, s in enumerate(seen):
        if rank == 2:  # its own error, every frame of it
            assert s["frames"][-1][2] == 'raise OSError("disk full on rank 2")', s
            continue
        assert len(s["frames"]) == 2 and s["frames"][0] == user, (rank, s)
        assert s["frames"][1][:2] == ("schedule.py", "__enter__" if order == "master" or rank == 3 else "__exit__")
        assert s["frames"][1][2].startswith("raise error  # the block's ranks failed"), (rank, s)


@channels
def test_ordered_failure_in_the_middle(world: World) -> None:
    if world.serial:
        pytest.skip("needs several ranks")
    seen = world(_bodies.fail, "ordered", 2)
    assert [s["outcome"] for s in seen] == ["RankFailedError", "RankFailedError", "OSError", "RankFailedError"]
    assert [s["ran"] for s in seen] == [True, True, True, False]
    for r in (0, 1, 3):
        assert seen[r]["failures"] == [(2, "OSError", "disk full on rank 2")]
    assert [s["sum"] for s in seen] == [4] * 4, "the world is unusable after the failure"


@channels
def test_failure_of_a_later_rank_reaches_the_first(world: World) -> None:
    if world.serial:
        pytest.skip("needs several ranks")
    seen = world(_bodies.fail, "master", 3)
    assert [s["outcome"] for s in seen] == ["RankFailedError"] * 3 + ["OSError"]
    assert all(s["ran"] for s in seen)
    assert seen[0]["failures"] == [(3, "OSError", "disk full on rank 3")]
    assert [s["sum"] for s in seen] == [4] * 4, "the world is unusable after the failure"


@pytest.mark.parametrize("kind", ["out_of_range", "negative", "mismatch", "wrong_type", "not_a_policy", "bad_timeout"])
@channels
def test_bad_input_is_a_value_error_on_every_rank(world: World, kind: str) -> None:
    if world.serial and kind in ("mismatch",):
        pytest.skip("a single rank cannot disagree with itself")
    seen = world(body_bad_args, kind)
    if world.serial and kind in ("wrong_type", "not_a_policy", "bad_timeout"):
        return  # rank 0 passes valid arguments in these cases; only other ranks' inputs are bad
    assert [s["outcome"] for s in seen] == ["ValueError"] * len(seen), seen
    assert not any(s["ran"] for s in seen)
    if kind == "out_of_range":
        assert f"rank should be between 0 and {len(seen) - 1}" in seen[0]["message"]
    if kind == "mismatch":
        assert "ranks [0, 1]" in seen[3]["message"] and "ranks [2, 3]" in seen[0]["message"]


def body_small_world() -> list[str]:
    seen = []
    for _ in range(3):
        with idist.one_rank_first() as first:
            seen.append("first" if first else "after")
    try:
        with idist.one_rank_first(rank=min(idist.get_rank(), 1)):
            seen.append("ran")
    except ValueError as exc:
        seen.append(str(exc))
    return seen


@pytest.mark.parametrize("nprocs", [2, 3])
def test_two_and_three_ranks_judge_the_entries_they_read_one_by_one(world: World, nprocs: int) -> None:
    # With at most two other entries, the last rank to enter reads each one instead of a multi_get.
    seen = world(body_small_world, nprocs=nprocs)
    assert [s[:3] for s in seen] == [["first"] * 3] + [["after"] * 3] * (nprocs - 1)
    for s in seen:
        assert "different one_rank_first arguments" in s[3] and "ranks [0]" in s[3], s
        assert "ranks [1]" in s[3] or "ranks [1, 2]" in s[3], s


@pytest.mark.slow
def test_first_block_may_outlive_the_process_group_timeout(world: World) -> None:
    seen = world(_bodies.long_first_rank, 15.0, pg_timeout=5.0, deadline=90)
    assert [s["outcome"] for s in seen] == ["ok"] * 4
    assert [s["sum"] for s in seen] == [4] * 4
    assert all(s["start"] >= seen[0]["end"] for s in seen[1:])


def test_waiting_ranks_log_whom_they_wait_for(world: World) -> None:
    seen = world(body_logs, 3.5, env={"IGNITE_EXT_WAIT_LOG_INTERVAL": "1"})
    assert seen[0]["logs"] == [], "the first rank waits for nobody"
    for s in seen[1:]:
        waits = [m for m in s["logs"] if "waited" in m and "for rank 0" in m]
        assert 2 <= len(waits) <= 4, s["logs"]  # about one line per interval, never a flood


def test_timeout_raises_on_waiting_ranks(world: World) -> None:
    seen = world(_bodies.long_first_rank, 4.0, 1.0)
    assert [s["outcome"] for s in seen[1:]] == ["TimeoutError"] * 3
    assert all("for rank 0" in s["message"] for s in seen[1:])
    assert not any(s["ran"] for s in seen[1:])
    assert seen[0]["outcome"] == "RankFailedError" and seen[0]["ranks"] == [1, 2, 3]


@pytest.mark.parametrize("victim", [1, 0])
def test_sigkilled_first_rank_is_an_error_not_a_hang(world: World, victim: int) -> None:
    start = time.monotonic()
    results = world.results(_bodies.killed, victim, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": "5"}, deadline=90)
    assert results[victim].killed
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, str(r)
        assert r.value["outcome"] == "RankFailedError", r.value
        assert not r.value["ran"]
    assert time.monotonic() - start < 60
    if victim == 1:  # rank 0 hosts the store and stays alive: the keeper, or the heartbeat, names the dead rank
        assert all(r.value["ranks"] == [1] for r in results if r.rank != victim)
        # A fresh world: rank 1 may die before its keeper is up, and then only its silence tells.
        how = ("its process was killed or crashed", "no heartbeat")
        assert all(any(h in r.value["message"] for h in how) for r in results if r.rank != victim), results
    else:  # the store died with rank 0
        assert all("rendezvous store" in r.value["message"] for r in results if r.rank != victim)


@channels
def test_nested_use_does_not_deadlock(world: World) -> None:
    seen = world(body_nested)
    assert [s["outcome"] for s in seen] == ["ok"] * len(seen)
    assert [s["after"] for s in seen] == ["ok"] * len(seen)
    assert seen[0]["inner"] == [True, True]
    assert all(s["inner"] == [False, False] for s in seen[1:])


@channels
def test_repeated_use_keeps_ranks_in_step(world: World) -> None:
    seen = world(body_repeated, 20)
    assert seen == [["ok"] * 20] * len(seen)


def test_finalize_right_after_the_block_loses_no_outcome(world: World) -> None:
    for _ in range(3):
        assert world(body_finalize_right_after) == ["ok"] * 4


def test_many_back_to_back_blocks_with_frequent_key_cleanup(world: World) -> None:
    # Old keys are deleted in the background (on each heartbeat, every 0.2 s here): no rank may lose a key of
    # a block it is still in, however far the other ranks have moved on.
    seen = world(body_repeated, 400, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": "1.2"}, deadline=150)
    assert seen == [["ok"] * 400] * 4


def body_drains_after_the_others_acknowledged(others_exit: bool) -> dict[str, Any]:
    from ignite_ext.distributed._lingering import Lingering
    from ignite_ext.distributed.store.clients import read

    with idist.one_rank_first():
        pass
    if idist.get_rank() != 0:
        if not others_exit:
            time.sleep(4.0)  # alive, between blocks: the heartbeat's next beat acknowledges
        return {}  # else the process ends now: its exit acknowledges
    assert Lingering.pending is not None
    store, keys, _, _ = Lingering.pending
    start = time.monotonic()
    Lingering.drain()  # what rank 0's exit does
    return {"waited": time.monotonic() - start, "acked": read(store, keys.acked)}


@pytest.mark.parametrize("others_exit", [False, True], ids=["others-alive", "others-exit"])
def test_rank_0_exit_waits_for_the_acknowledgements_that_no_block_waits_for(world: World, others_exit: bool) -> None:
    # The others acknowledge the last block at their next beat (T/6 = 1 s here) or at their exit, not in the block.
    # Rank 0 waits for that at its exit, at most T (6 s); half of T leaves 2 beats of margin on a loaded machine.
    t = 6.0
    results = world(
        body_drains_after_the_others_acknowledged, others_exit, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)}
    )
    assert results[0]["acked"] == b"1", results
    assert results[0]["waited"] < t / 2, results


def body_failing_blocks_store_keys() -> list[int]:
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    counts = []
    for rounds in (10, 30):
        for i in range(rounds):
            try:
                with idist.one_rank_first():
                    if idist.get_rank() == 1 and i % 2 == 0:
                        raise ValueError("half of the blocks fail on rank 1")
            except (ValueError, idist.RankFailedError):
                pass
        time.sleep(1.0)  # heartbeats (every 0.2 s here) run the deferred deletions
        counts.append(store.num_keys())
    return counts


def test_keys_of_finished_blocks_do_not_accumulate_in_the_store(world: World) -> None:
    # Ranks 1..3 still run deferred deletions while rank 0 counts, so compare after a pause, on every rank.
    counts = world(body_failing_blocks_store_keys, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": "1.2"})
    for after_10, after_40 in counts:
        assert after_40 <= after_10 + 2, counts  # 15 more failed blocks must leave no keys behind


class _SchedulingDataset(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        with idist.one_rank_first():
            return index


@pytest.mark.distributed  # starts a DataLoader worker process
def test_dataloader_worker_gets_a_clear_error() -> None:
    loader = torch.utils.data.DataLoader(_SchedulingDataset(), num_workers=1)
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        next(iter(loader))


def test_serial_mode_yields_truthy() -> None:
    with idist.one_rank_first() as download:
        assert download
    with idist.rank_scheduler(order=idist.Ordered()) as turn:
        assert turn and turn.group == (0,)
    with pytest.raises(ValueError, match="rank should be between 0 and 0"), idist.one_rank_first(rank=1):
        pass
