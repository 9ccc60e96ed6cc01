"""Waiting ranks' progress lines reach a job's log when the application configures no logging.

The job runs under the real ``torchrun`` with every rank's output going to a file (as under SLURM or any launcher
that writes logs): no terminal, no ``logging`` set-up in the script. The first rank reports progress for a few wait
intervals; the waiting rank must log whom it waits for, with that progress, at INFO. An application that did
configure logging (a root handler, or a level on the package's logger) keeps its choice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.5  # IGNITE_EXT_WAIT_LOG_INTERVAL of the job: rank 0 works for 8 of them
SCRIPT = textwrap.dedent(
    """
    import logging, sys, time
    import ignite_ext.distributed as idist
    from ignite_ext import progress
    if sys.argv[1] == "basic":
        logging.basicConfig(level=logging.WARNING)  # the application's choice: warnings only
    idist.initialize("gloo")
    with idist.one_rank_first() as first:
        if first:
            for _ in progress.track(range(8), what="preparing shards"):
                time.sleep(INTERVAL)
    rank = idist.get_rank()
    idist.finalize()
    print(f"rank {rank} done", flush=True)
    """
).replace("INTERVAL", str(INTERVAL))


def _job(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    log = tmp_path / f"{mode}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "IGNITE_EXT_WAIT_LOG_INTERVAL": str(INTERVAL)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), mode]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "rank 0 done" in text and "rank 1 done" in text, text
    return text


@pytest.mark.timeout(300)
def test_a_waiting_rank_logs_the_first_ranks_progress_with_no_logging_configured(tmp_path: Path) -> None:
    text = _job(tmp_path, "plain")
    waiting = [line for line in text.splitlines() if "rank 1 has waited" in line]
    assert waiting, text
    assert all(" ignite_ext.distributed INFO: " in line for line in waiting), waiting  # ignite's format
    assert any("preparing shards" in line for line in waiting), waiting  # with the first rank's progress


@pytest.mark.timeout(300)
def test_an_application_that_configured_logging_keeps_its_level(tmp_path: Path) -> None:
    text = _job(tmp_path, "basic")
    assert "has waited" not in text, text
