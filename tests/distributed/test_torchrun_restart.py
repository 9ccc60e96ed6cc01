"""A job restarted by the real ``torchrun --max-restarts``: the restarted attempt's blocks run as a first attempt's.

torchrun's agent keeps one store for every attempt of a job, and torch puts a restarted group's keys under the
prefix the failed attempt used: the scheduler read the attempt before's keys as its own, and the restarted
attempt's first block waited for ever (0 of 8 restarted attempts got through it). Each attempt now has keys of its
own (``ignite_ext.distributed.store.keys.ROOT``). Plain ignite runs the same script beside, as the control.

torch's own re-forming of a restarted gloo group can fail on this machine (a peer address of the failed attempt
still in the agent's store: about half the restarts, with the package or without): a try whose group did not
re-form is tried again, up to three times, and the test is skipped with the tries' reasons if none re-formed. Every
try whose group re-formed must run its block and finish.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BOUND_S = 15.0  # a first block costs 0.1-0.2 s here; the failure it guards against is a wait for ever

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import importlib
    from datetime import timedelta

    def say(line):  # one write per line: both ranks write to the same file
        os.write(1, (line + "\\n").encode())

    idist = importlib.import_module(sys.argv[1])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    idist.initialize("gloo", timeout=timedelta(seconds=10))  # a group that does not re-form fails in 10 s
    rank = idist.get_rank()
    say(f"attempt {attempt} rank {rank}: group formed")
    start = time.monotonic()
    with idist.one_rank_first():
        pass
    say(f"attempt {attempt} rank {rank}: block in {time.monotonic() - start:.2f} s")
    if attempt == 0 and rank == 1:
        raise RuntimeError("rank 1 fails in attempt 0")
    if attempt == 0:
        time.sleep(120)  # until the agent stops it, to restart the group
    idist.finalize()
    say(f"attempt {attempt} rank {rank}: done")
    """
)


def _torchrun(tmp_path: Path, module: str, tries: int = 3) -> tuple[str, list[str]]:
    """The log of the first try whose restarted group formed (or the last), and why the others were tried again."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "--monitor-interval=0.5", str(script), module]  # fmt: skip
    retried: list[str] = []
    log = ""
    for attempt in range(tries):
        out = tmp_path / f"{module}-{attempt}.log"
        with out.open("w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        log = out.read_text()
        formed = len(_said(log, 1, "group formed"))
        if formed == 2:
            return log, retried
        retried.append(f"try {attempt}: the restarted group did not form ({formed} of 2 ranks)")
    return log, retried


def _said(log: str, attempt: int, what: str) -> list[str]:
    """What the script said of ``attempt`` (``what``: a regular expression after "attempt A rank R: "), found
    anywhere in the log: torch's own lines may share a line with the script's."""
    return re.findall(rf"attempt {attempt} rank (\d+): {what}", log)


@pytest.mark.distributed
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("module", ["ignite_ext.distributed", "ignite.distributed"])
def test_a_restarted_attempt_runs_its_first_block_as_a_first_attempt_does(tmp_path: Path, module: str) -> None:
    log, retried = _torchrun(tmp_path, module)
    if len(_said(log, 1, "group formed")) < 2:
        # torch's own re-forming (the control without the package fails the same way): not this package's to test.
        pytest.skip(f"torch's restarted gloo group did not form in {len(retried)} tries: {retried}")
    blocks = re.findall(r"attempt 1 rank \d+: block in ([0-9.]+) s", log)
    assert len(blocks) == 2, log[-4000:]
    assert all(float(seconds) < BLOCK_BOUND_S for seconds in blocks), blocks
    assert sorted(_said(log, 1, "done")) == ["0", "1"], log[-4000:]
    assert sorted(_said(log, 0, "block in")) == ["0", "1"], log[-4000:]  # the failed attempt ran its block first
