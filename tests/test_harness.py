"""The test harness itself: ``-m "not distributed"`` starts no world, and a world's deadline kills and reaps it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._world import ROOT, RankResult, World, WorldDeadlineError, run_world

# Multi-process tests that once ran under -m "not distributed", and serial ones that must keep running there.
MULTI_PROCESS = [
    "tests/distributed/test_schedule.py::test_sigkilled_first_rank_is_an_error_not_a_hang[1]",
    "tests/distributed/test_schedule.py::test_master_first_runs_first_rank_before_the_others[store]",
    "tests/distributed/test_schedule.py::test_master_first_runs_first_rank_before_the_others[collective]",
    "tests/distributed/test_schedule.py::test_timeout_raises_on_waiting_ranks",
    "tests/distributed/test_schedule.py::test_dataloader_worker_gets_a_clear_error",
    "tests/backends/test_matrix.py::test_world_runs_on_its_backend[gloo-4]",
    "tests/backends/test_matrix.py::test_world_runs_on_its_backend[xla-1]",
    "tests/backends/test_waiting.py::test_first_rank_killed[horovod-4]",
    "tests/test_harness.py::test_deadline_dumps_stacks_then_kills_and_reaps",
]
SERIAL = [
    "tests/distributed/test_schedule.py::test_master_first_runs_first_rank_before_the_others[serial]",
    "tests/backends/test_matrix.py::test_world_runs_on_its_backend[serial]",
    "tests/test_harness.py::test_serial_world_runs_in_this_process[serial]",
]


def test_not_distributed_selects_no_world(tmp_path: Path) -> None:
    report = tmp_path / "collected.json"
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not distributed", "tests"]
    env = {**os.environ, "IGNITE_EXT_WORLD_REPORT": str(report)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    items = {item["nodeid"]: item for item in json.loads(report.read_text())}
    selected = [i for i in items.values() if i["selected"]]
    assert selected and len(selected) < len(items)
    # Every test in a world other than the serial one is marked distributed, and so never selected here.
    assert [i["nodeid"] for i in items.values() if i["world"] not in (None, "serial") and not i["distributed"]] == []
    assert [i["nodeid"] for i in selected if i["distributed"]] == []
    for nodeid in MULTI_PROCESS:
        assert nodeid in items and not items[nodeid]["selected"], nodeid
    for nodeid in SERIAL:
        assert items[nodeid]["selected"], nodeid


def test_test_modules_start_worlds_through_the_fixture() -> None:
    # A direct run_world call would bypass the fixture, and with it the distributed mark.
    harness = {Path("tests/_world.py"), Path("tests/conftest.py"), Path("tests/test_harness.py")}
    direct = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.relative_to(ROOT) not in harness and "run_world(" in path.read_text()
    ]
    assert direct == [], "use the world fixture instead of run_world"


def test_a_test_without_the_mark_cannot_start_a_process() -> None:
    with pytest.raises(RuntimeError, match="not marked distributed"):
        mp.get_context("fork").Process(target=os.getpid).start()
    with pytest.raises(RuntimeError, match="not marked distributed"):
        run_world(os.getpid, 2, backend=None)


def _where() -> tuple[int, str | None, str | None]:
    return os.getpid(), os.environ.get("RANK"), os.environ.get("IGNITE_EXT_HARNESS_PROBE")


@pytest.mark.parametrize("world", ["serial"], indirect=True)
def test_serial_world_runs_in_this_process(world: World) -> None:
    assert world.serial and (world.nprocs, world.nproc_per_node) == (1, 1)
    assert world(_where, env={"IGNITE_EXT_HARNESS_PROBE": "x"}) == [(os.getpid(), None, None)]
    results = world.results(_fail, "serial")
    assert not results[0].ok and results[0].exc_type == "ValueError" and "_fail" in str(results[0].traceback)
    with pytest.raises(AssertionError, match="ValueError: serial"):
        world(_fail, "serial")


def _fail(message: str) -> None:
    raise ValueError(message)


def _layout() -> dict[str, Any]:
    import ignite_ext.distributed as idist

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "IGNITE_EXT_HARNESS_PROBE")
    return {"env": [os.environ.get(k) for k in keys], "backend": idist.backend(), "node": idist.get_node_rank()}


def test_options_reach_every_rank(world: World) -> None:
    assert (world.name, world.backend, world.nprocs, world.nproc_per_node) == ("gloo", "gloo", 4, 4)
    env = {"IGNITE_EXT_HARNESS_PROBE": "y"}
    seen = world(_layout, nprocs=2, nproc_per_node=1, env=env)
    assert [s["env"] for s in seen] == [["0", "2", "0", "y"], ["1", "2", "0", "y"]]
    assert [(s["backend"], s["node"]) for s in seen] == [("gloo", 0), ("gloo", 1)]
    plain = world(_layout, nprocs=3, backend=None)
    assert [(s["env"][:2], s["backend"]) for s in plain] == [([str(r), "3"], None) for r in range(3)]
    results = world.results(_fail, "rank", nprocs=2, backend=None)
    assert [(r.ok, r.exc_type, r.message) for r in results] == [(False, "ValueError", "rank")] * 2
    with pytest.raises(AssertionError, match="some ranks failed") as failed:
        world(_fail, "rank", nprocs=2, backend=None)
    report = str(failed.value)  # every failing rank, each with its traceback
    assert "rank 0: ValueError: rank" in report and "rank 1: ValueError: rank" in report
    assert report.count("in _fail") == 2, report


def _hang() -> None:
    if os.environ["RANK"] == "0":
        return  # one rank finishes: only the others are timed out
    time.sleep(600)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a zombie (killed, not reaped) still exists
    except ProcessLookupError:
        return False
    return True


def test_deadline_dumps_stacks_then_kills_and_reaps(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    pids: list[int] = []
    start = time.monotonic()
    results = world.results(
        _hang,
        nprocs=3,
        backend=None,
        deadline=5,
        allow_deadline=True,
        on_start=lambda procs: pids.extend(p.pid for p in procs),
    )
    assert time.monotonic() - start < 30
    assert isinstance(results[0], RankResult) and results[0].ok and not results[0].timed_out
    assert [(r.timed_out, r.killed) for r in results[1:]] == [(True, True)] * 2
    # faulthandler on SIGUSR1 before the SIGKILL: where each rank was stuck, every thread, on the test's stderr
    dump = capsys.readouterr().err
    for rank in (1, 2):
        assert f"rank {rank} and its children, every thread:" in dump, dump
    assert dump.count("in _hang") == 2, dump
    assert len(pids) == 3 and not any(_exists(pid) for pid in pids), "a rank was not reaped"
    with pytest.raises(WorldDeadlineError, match=r"ranks \[1\] were still running after 3s") as late:
        world(_hang, nprocs=2, backend=None, deadline=3)
    # The error itself says where: the late rank's main thread, as the CI's excerpt of a failure shows it.
    assert "rank 1 (or a process it forked), main threads:" in str(late.value), late.value
    assert "in _hang" in str(late.value), late.value
