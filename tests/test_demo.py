"""The end-to-end demo (``python -m ignite_ext demo``) runs offline and prints the summary it promises."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240.0


@pytest.mark.distributed
@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_demo_fetches_once_per_job_and_hits_the_cache_from_epoch_two() -> None:
    proc = subprocess.Popen(
        [
            # With progress bars asked for: stdout and stderr are pipes here, as in a job log, so none may be drawn.
            *(sys.executable, "-m", "ignite_ext", "demo", "--epochs", "2", "--samples", "400"),
            *("--timeout", str(TIMEOUT_S - 30)),  # the demo kills its node launchers itself when time is up
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Each node launcher runs in a process group of its own, which the demo kills on the way out: interrupt
        # it first so that it can, then kill its own group.
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the demo ran past {TIMEOUT_S:.0f} s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"

    assert "== ignite_ext demo: 4 ranks on 2 nodes, 2 epochs ==" in out, out
    # Start-up and training say what they are doing, before the report.
    said = [line for line in out.splitlines() if line.startswith("[demo] ")]
    for step in ("starting 2 node launchers", "process group up (4 gloo ranks)", "training 2 epochs", "epoch 2 done"):
        assert sum(step in line for line in said) == 1, (step, said)
    assert re.search(r"server sent [\d.]+ MB: 1\.00 archive for 2 nodes", out), out
    rows = re.findall(r"^\s*(\d+) \|\s+[\d.]+ \|\s+(\d+)% \|\s+(\d+) \|", out, re.M)
    assert [(epoch, rate) for epoch, rate, _ in rows] == [("1", "0"), ("2", "100")], out
    assert rows[0][2] == "400" and rows[1][2] == "0", out
    assert "training samples: 400" in out
    # Each rank's line says what it counts: its reads, split into cache hits and loads from storage.
    ranks = re.findall(
        r"^\[rank (\d) \| node \d\].* shard: (\d+) samples  samples read by this rank: (\d+) "
        r"\((\d+) from the cache, (\d+) from storage; (\d+) stored\)",
        out,
        re.M,
    )
    assert [r[0] for r in ranks] == ["0", "1", "2", "3"], out
    for _, shard, reads, hits, loads, _ in ranks:
        assert int(reads) == 2 * int(shard) == int(hits) + int(loads), out
    assert sum(int(r[4]) for r in ranks) == sum(int(r[5]) for r in ranks) == 400, out
    assert "\r" not in out + err, "a progress bar was drawn into a pipe"
