"""Smoke tests of the scripts in ``examples/``: each runs as a user would run it, and its output is checked."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._world import free_port

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 150.0

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 30)]


def run_example(script: str, *args: str) -> str:
    """Run ``examples/<script>`` with ``args``; return its stdout, failing on a non-zero exit or a timeout."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),  # never the default 2222 that other worlds may hold
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, f"examples/{script}", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the ranks and their workers too
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)} ran past {TIMEOUT_S:.0f} s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    return out


def test_ordered_printing_reports_come_in_rank_order_and_unbroken() -> None:
    lines = run_example("ordered_printing.py", "--nproc", "4").splitlines()
    begins = [i for i, line in enumerate(lines) if line.endswith("report begins")]
    assert [lines[i].split("/")[0] for i in begins] == [f"[rank {r}" for r in range(4)], lines
    for rank, start in enumerate(begins):
        report = lines[start : start + 5]
        assert report[-1] == f"[rank {rank}] report ends", lines
        assert all(line.startswith("  ") for line in report[1:-1]), lines
        assert f"local rank {rank}," in report[1]
        assert "sum of all ranks (all_reduce): 6" in report[3]


def test_download_first_rank_downloads_once() -> None:
    out = run_example("download_first_rank.py", "--nproc", "4", "--start-method", "fork")
    for rank in range(4):
        assert re.search(rf"^rank {rank}: download={rank == 0}; 1000 samples, first '0,0'$", out, re.M), out
    assert "downloaded by ranks [0]" in out
    assert re.search(r"^server: 1 request\(s\), sent \d+ bytes \(1\.00 copies\)$", out, re.M), out


def test_download_first_rank_failure_reaches_the_other_ranks() -> None:
    out = run_example("download_first_rank.py", "--nproc", "4", "--start-method", "fork", "--fail")
    assert re.search(r"^rank 0: download=True; DownloadError: .*404", out, re.M), out
    for rank in range(1, 4):
        # the rank's line and the failure's indented paragraph (rank 0's error and where it raised)
        report = re.search(rf"^rank {rank}: .*(?:\n  .*)*", out, re.M)
        assert report is not None, out
        assert report.group(0).startswith(f"rank {rank}: download=False; RankFailedError: "), report.group(0)
        assert "rank(s) [0] failed" in report.group(0) and "\n  rank 0: DownloadError: " in report.group(0)
        assert "rank 0's traceback, innermost frames:" in report.group(0), report.group(0)
    assert "downloaded by ranks []" in out
    assert "sent 0 bytes" in out


def test_download_per_node_makes_a_copy_per_directory_and_fetches_once_per_job() -> None:
    out = run_example("download_per_node.py", "--nproc", "4", "--start-method", "fork")
    for rank in range(4):
        node, leader = rank // 2, rank // 2 * 2
        group = [leader, leader + 1]
        expected = f"rank {rank}: node{node}/ group {group} leader {leader} first={rank == leader};"
        assert expected in out, out
    assert re.search(r"^server sent \d+ bytes: 1\.00 archives", out, re.M), out


@pytest.mark.parametrize("extra", [(), ("--node", "--start-method", "fork")], ids=["rank-cache", "node-cache"])
def test_cached_ddp_training_hits_from_the_second_epoch(extra: tuple[str, ...]) -> None:
    out = run_example("cached_ddp_training.py", "--nproc", "4", "--epochs", "3", "--samples", "256", *extra)
    rates = re.findall(r"^epoch (\d): cache hit rate (\d+)% \((\d+) hits, (\d+) loads\)", out, re.M)
    assert rates == [("1", "0", "0", "256"), ("2", "100", "256", "0"), ("3", "100", "256", "0")], out
    assert len(re.findall(r"^rank \d: 64 samples per epoch", out, re.M)) == 4, out


def _torchrun_example(script: str, max_restarts: int, *args: str) -> tuple[int, str]:
    """Run ``examples/<script>`` under the real ``torchrun --standalone`` (2 ranks): its exit status and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         f"--max-restarts={max_restarts}", "--monitor-interval=0.5", f"examples/{script}", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} under torchrun did not finish in {TIMEOUT_S:.0f} s:\n{out[-4000:]}")
    return proc.returncode, out


def _left(out: str) -> list[str]:
    """The node caches the job's attempts named that are still on the host (their arenas and locks)."""
    arenas = re.findall(r"node cache (\S+\.arena)(?: (\S+\.arena))?", out)
    arenas = [a for pair in arenas for a in pair if a]
    assert arenas, out[-4000:]
    return [f for a in arenas for f in (a, a[: -len(".arena")] + ".lock") if os.path.exists(f)]


@pytest.mark.parametrize("fail", ["raise", "kill"])
def test_torchrun_restart_serves_the_restarted_first_epoch_from_the_adopted_cache(fail: str, tmp_path: Path) -> None:
    # The real launcher: rank 1 fails in the first attempt's second epoch; the other rank fails in a collective
    # or is SIGTERMed by the agent, with a restart left: both keep the node cache (RAM and disk tiers), which the
    # restart adopts.
    code, out = _torchrun_example("torchrun_restart.py", 1, "--fail", fail, "--disk-dir", str(tmp_path))
    assert code == 0, out[-4000:]
    assert "attempt 0 epoch 1: 0 hits, 256 loads from storage" in out, out[-4000:]
    assert "attempt 1 epoch 1: 256 hits, 0 loads from storage" in out, out[-4000:]
    assert "attempt 1: done" in out and _left(out) == [] and not list(tmp_path.glob("*.arena")), out[-4000:]


def test_torchrun_last_attempt_leaves_nothing_of_the_cache(tmp_path: Path) -> None:
    # No restart left: the job fails, and the surviving rank (failed in a collective, or SIGTERMed) deletes the
    # node cache (both tiers) instead of keeping it for a restart that cannot come.
    code, out = _torchrun_example("torchrun_restart.py", 0, "--fail", "raise", "--disk-dir", str(tmp_path))
    assert code != 0 and "attempt 0: rank 1 fails (raise)" in out, out[-4000:]
    assert "attempt 1" not in out and _left(out) == [] and not list(tmp_path.glob("*.arena")), out[-4000:]
