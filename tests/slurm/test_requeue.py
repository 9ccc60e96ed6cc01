"""A Slurm job's end, and what it leaves of its node cache: every case of the rule, on a Slurm node the test starts.

At a ``SIGTERM`` a node cache is kept only if Slurm has counted a requeue of its job; a sweep keeps a stale one
while its job will come back to the node (``ignite_ext._slurm``). The requeued run's adoption
itself is the launchers page's requeue recipe (``test_launch_forms.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ignite_ext import _slurm
from ignite_ext.data.cache import restart, shm
from ignite_ext.data.cache._life import _stamps
from tests._slurm import SlurmBed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: A 2-rank gloo job starts in 3-6 s here; the margin is for a loaded machine.
DEADLINE_S = 120


def _sbatch(slurm: SlurmBed, folder: Path, *options: str, command: str) -> str:
    script = folder / "job.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output={folder}/job.out\n{command}\n")
    done = subprocess.run(
        ["sbatch", "--parsable", *options, str(script)], env=slurm.job_env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _wait_for(what: str, ready: object, deadline_s: float = DEADLINE_S, show: object = None) -> None:
    deadline = time.monotonic() + deadline_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s; {show() if show else ''}"  # type: ignore[operator]
        time.sleep(0.2)


def _job_arenas(job: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The arenas in /dev/shm stamped with Slurm job ``job`` of the bed's cluster."""
    with monkeypatch.context() as patch:
        patch.setenv("SLURM_JOB_ID", job)
        patch.setenv("SLURM_CLUSTER_NAME", "ietest")
        patch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        key = restart.job_key()
    return [
        p
        for p in (os.path.join(shm.SHM_DIR, n) for n, _, _ in shm.own_files(shm.SHM_DIR))
        if p.endswith(".arena") and _stamps(p)[0] == key
    ]


def _state(slurm: SlurmBed, job: str) -> str:
    shown = slurm.run(["scontrol", "show", "job", "-o", job], check=False)
    match = re.search(r"JobState=(\S+)", shown)
    return match.group(1) if match else "GONE"


@pytest.mark.parametrize("requeueable", [True, False], ids=["requeue", "no-requeue"])
def test_a_cancelled_job_leaves_no_node_cache(
    slurm: SlurmBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requeueable: bool
) -> None:
    option = "--requeue" if requeueable else "--no-requeue"
    job = _sbatch(slurm, tmp_path, option, command="srun python -m tests.slurm._cache_body")
    out = tmp_path / "job.out"
    log = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    _wait_for("both ranks filled the node cache", lambda: log().count("filled ") == 2, show=log)
    assert len(_job_arenas(job, monkeypatch)) == 1, "the node cache is not in /dev/shm while the job runs"
    slurm.run(["scancel", job])
    # CANCELLED once no process of the job is left (COMPLETING until then)
    _wait_for("the job ended", lambda: _state(slurm, job) in ("CANCELLED", "GONE"), show=lambda: _state(slurm, job))
    assert _job_arenas(job, monkeypatch) == [], f"a cancelled job left its node cache; {log()}"


def _running(slurm: SlurmBed, job: str) -> None:
    _wait_for(f"job {job} runs", lambda: _state(slurm, job) == "RUNNING", show=lambda: _state(slurm, job))


def test_a_sweep_keeps_a_slurm_jobs_cache_while_the_job_will_come_back_to_the_node(
    slurm: SlurmBed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "held").mkdir()
    (tmp_path / "running").mkdir()
    held = _sbatch(slurm, tmp_path / "held", "--hold", command="sleep 100")
    running = _sbatch(slurm, tmp_path / "running", command="sleep 100")
    _running(slurm, running)
    # A cache of the running job, left by a rank killed with SIGKILL (no cleanup ran): stale, stamped with the job.
    code = (
        "import os, sys\n"
        "from ignite_ext.data.cache import restart\n"
        "from ignite_ext.data.cache._life import ArenaFile\n"
        "arena = ArenaFile.create(4, 1 << 16, directory=sys.argv[1], job=restart.job_key())\n"
        "print(arena.path, flush=True)\n"
        "os._exit(0)\n"
    )
    env = slurm.job_env(SLURM_JOB_ID=running, SLURM_CLUSTER_NAME="ietest")
    made = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    left = made.stdout.strip()
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("SLURMD_NODENAME", slurm.node)

    def word(job: str, restarts: int = 0) -> int:
        return _slurm.MARK | restarts << 32 | int(job)

    cases = {
        "pending (held, requeued, preempted)": (word(held), True),
        "running on this node": (word(running), True),
        "requeued, and running on this node again": (word(running, 1), True),
        "unknown to Slurm": (word("4000000000"), False),
        "not a Slurm stamp": (os.getpid(), False),
    }
    got = {case: _slurm.brings_back(stamp) for case, (stamp, _) in cases.items()}
    assert got == {case: expected for case, (_, expected) in cases.items()}
    assert shm.sweep_stale(str(tmp_path)) == [] and os.path.exists(left), "the running job's cache was swept"
    monkeypatch.setenv("SLURMD_NODENAME", "elsewhere")  # this node, as Slurm names it, is not the job's
    assert not _slurm.brings_back(word(running)) and not _slurm.brings_back(word(running, 1))
    assert left in shm.sweep_stale(str(tmp_path)), "the cache of a job that runs on other nodes was not swept"
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path / "nothing"))  # no scontrol: nobody says the job comes back
        patch.setenv("SLURMD_NODENAME", slurm.node)
        assert not _slurm.brings_back(word(held))
    monkeypatch.setenv("SLURMD_NODENAME", slurm.node)
    slurm.run(["scancel", running])
    _wait_for("the job ended", lambda: _state(slurm, running) in ("CANCELLED", "GONE"))
    assert not _slurm.brings_back(word(running)), "an ended job comes back"
