"""torchrun inside a Slurm job step: ``idist.Parallel`` forms the group torchrun describes (without Slurm itself).

Each case runs one rank in a fresh interpreter with the environment ``srun ... torchrun`` gives it: Slurm's
variables count the agents (2 tasks), torchrun's count the ranks (a group of 1 here, so it forms alone). Plain
ignite refuses it; the package forms the group, and gives ``SLURM_JOB_ID`` back when the group ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._world import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]

BODY = """
import os
import {module} as idist

with idist.Parallel(backend="gloo") as parallel:
    parallel.run(lambda local_rank: print("formed", idist.get_rank(), idist.get_world_size(), local_rank))
print("after", os.environ.get("SLURM_JOB_ID"))
"""

#: The second of two agents on one node (``srun -n 2 torchrun --nnodes=2 --nproc-per-node=1``), and the second
#: node's agent of ``srun --ntasks-per-node=1 torchrun --nnodes=2`` where torchrun gave it rank 0.
CASES = {
    "two-agents-one-node": {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1"},
    "one-agent-per-node": {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2"},
}


def _run(module: str, slurm: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(slurm, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", PYTHONPATH=str(ROOT))
    env.update(TORCHELASTIC_RUN_ID="none", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", BODY.format(module=module)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_parallel_reads_torchrun_not_slurm(case: str) -> None:
    done = _run("ignite_ext.distributed", CASES[case])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "formed 0 1 0" in done.stdout, done.stdout
    assert "after 4242" in done.stdout, "SLURM_JOB_ID did not come back after the group ended"


def test_plain_ignite_refuses_it() -> None:
    # The control: the launch the package fixes is one ignite 0.5.5 refuses.
    done = _run("ignite.distributed", CASES["two-agents-one-node"])
    assert done.returncode != 0
    assert "inconsistent with equivalent SLURM env variable" in done.stderr, done.stderr[-3000:]
