"""What a failure costs: the time from a rank's failure to the restarted attempt's first batch, and its reads.

Two gloo ranks on one node run :mod:`benchmarks._failure_job`: an epoch over ``N`` samples (a file read and a
2 ms decode each), then a failure, then the restarted attempt's epoch. Side by side, in each launcher:

* the package: ``CachedDataset(scope="node")`` and its sampler, under ``ignite_ext.distributed``;
* plain ignite: the plain dataset and torch's ``DistributedSampler``, under ``ignite.distributed``.

The launchers:

* ``torchrun --standalone --nproc-per-node=2 --max-restarts=1``: rank 1 exits with 1 at the end of the first
  attempt, and torchrun restarts both ranks;
* ``sbatch --requeue`` of ``srun -n 2``: rank 0 requeues the job at the end of the first run, as a preemption does.
  Slurm holds a requeued job ``cred_expire`` seconds (120 by default) before it may start again: the benchmark
  starts it :data:`REQUEUE_HOLD_S` after the requeue (``scontrol update StartTime=now``). That hold is in the
  seconds reported; on a cluster, add Slurm's own and the queue's wait.

Reported: the seconds from the failure to the restarted attempt's first batch (interpreters, the group and the
cache's checks included), median over rounds; the samples the restarted attempt read from storage. The Slurm part
runs where ``sinfo`` answers (``SLURM_CONF`` or the cluster's configuration), the torchrun part everywhere.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NAME = "failure_cost"
ROOT = Path(__file__).resolve().parents[1]
SAMPLES = {"full": 2048, "quick": 128}
ROUNDS = {"full": 3, "quick": 1}
#: Seconds a requeued job is held here before it starts again: slurmd refuses the credentials of a job made within
#: the second its run before was revoked in ("Job credential revoked"), and Slurm then ends the job.
REQUEUE_HOLD_S = 2.0
#: A run's deadline: a restart takes seconds here; the margin is for a loaded machine.
DEADLINE_S = 300
VARIANTS = (("package", "ignite_ext.distributed", True), ("plain ignite", "ignite.distributed", False))


@contextlib.contextmanager
def requeued_after(hold_s: float, run: Callable[[list[str]], str]) -> Iterator[None]:
    """While inside, a requeued job starts ``hold_s`` after its requeue, not after Slurm's ``cred_expire``.

    ``run`` runs a Slurm command and returns its output (where the controller is reachable).
    """
    stop = threading.Event()

    def release() -> None:
        held_since: dict[str, float] = {}
        while not stop.wait(0.3):
            held = run(["squeue", "-h", "-t", "PENDING", "-o", "%i %r"]).splitlines()
            for job, _, reason in (line.partition(" ") for line in held):
                since = held_since.setdefault(job, time.monotonic()) if reason == "BeginTime" else None
                if since is not None and time.monotonic() - since >= hold_s:
                    run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
                    del held_since[job]

    thread = threading.Thread(target=release, name="slurm-requeued-after", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _command(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    return done.stdout


def _job(module: str, cached: bool, launcher: str, folder: Path, n: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks._failure_job",
        module,
        "1" if cached else "0",
        launcher,
        str(folder),
        str(n),
    ]


def _measured(folder: Path) -> dict[str, Any]:
    """What one run left in ``folder``: seconds from the failure to the restarted first batch, reads after it."""
    failed, first = folder / "failed", folder / "first_batch"
    reads = folder / "reads.1"
    return {
        "seconds": float(first.read_text()) - float(failed.read_text()) if first.exists() else None,
        "reads": reads.stat().st_size if reads.exists() else 0,
    }


def _torchrun(module: str, cached: bool, folder: Path, n: int, env: dict[str, str]) -> dict[str, Any]:
    argv = [
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        *_job(module, cached, "torchrun", folder, n)[1:],
    ]
    subprocess.run(["timeout", "-k", "5", str(DEADLINE_S), *argv], env=env, capture_output=True, cwd=ROOT)
    return _measured(folder)


def _slurm(module: str, cached: bool, folder: Path, n: int, env: dict[str, str]) -> dict[str, Any]:
    script = folder / "job.sbatch"
    job = " ".join(_job(module, cached, "slurm", folder, n))
    script.write_text(
        f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --requeue\n#SBATCH --output={folder}/job.out\nsrun {job}\n"
    )
    with requeued_after(REQUEUE_HOLD_S, lambda argv: _command(argv, env)):
        argv = ["timeout", "-k", "5", str(DEADLINE_S), "sbatch", "--wait", str(script)]
        subprocess.run(argv, env=env, capture_output=True, cwd=ROOT)
    return _measured(folder)


def slurm_answers(env: dict[str, str]) -> bool:
    """Whether a Slurm controller answers here (``sinfo``)."""
    if shutil.which("sinfo") is None:
        return False
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        return subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=20).returncode == 0
    return False


def run(quick: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Measure each launcher and variant; ``env``: the environment of the jobs (a Slurm's ``SLURM_CONF``)."""
    mode = "quick" if quick else "full"
    n = SAMPLES[mode]
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    launchers = {"torchrun": _torchrun, **({"slurm requeue": _slurm} if slurm_answers(env) else {})}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ignite_ext_failure_cost_") as tmp:
        for launcher, measure in launchers.items():
            for variant, module, cached in VARIANTS:
                runs = []
                for r in range(ROUNDS[mode]):
                    folder = Path(tmp) / f"{launcher}-{variant}-{r}".replace(" ", "_")
                    folder.mkdir()
                    runs.append(measure(module, cached, folder, n, env))
                seconds = [m["seconds"] for m in runs if m["seconds"] is not None]
                rows.append(
                    {
                        "label": f"{launcher}, {variant}",
                        "launcher": launcher,
                        "variant": variant,
                        "samples": n,
                        "restarted": f"{len(seconds)} of {len(runs)}",
                        "seconds to the restarted first batch": round(statistics.median(seconds), 2)
                        if seconds
                        else None,
                        "storage reads, restarted epoch": max(m["reads"] for m in runs),
                    }
                )
    return {
        "title": "What a failure costs (2 gloo ranks, one node)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "rows": rows,
        "summary": _summary(rows),
    }


def _summary(rows: list[dict[str, Any]]) -> str:
    parts = []
    for row in rows:
        took = row["seconds to the restarted first batch"]
        when = f"{took} s to the first batch" if took is not None else "no restarted batch"
        parts.append(
            f"{row['label']}: {when}, {row['storage reads, restarted epoch']} of {row['samples']} samples read again"
        )
    return "; ".join(parts) + (
        f" (Slurm's requeue hold set to {REQUEUE_HOLD_S:.0f} s here)"
        if any(r["launcher"] != "torchrun" for r in rows)
        else ""
    )


if __name__ == "__main__":
    from benchmarks._report import print_result

    print_result(run(quick="--quick" in sys.argv))
