"""Slurm over two nodes, each a simulated host with its own network, ``/tmp`` and ``/dev/shm``.

The launch forms of ``test_launch_forms.py`` with two ranks per node: ``srun`` one task per rank, and one torchrun
per node with c10d (the form ignite 0.5.5 refuses on two nodes: "WORLD_SIZE: 4 vs 2"), with the package and with
plain ignite. ``tests/slurm/_body.py`` downloads once per node into the node's own ``/tmp``, then rank 0 raises
in a block: every other rank must raise the package's error naming it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _hosts
from tests._slurm import KILL_WAIT_S, Lines, SlurmBed, lines_until, unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: A command's deadline: a 4-rank gloo job over two hosts takes 5-10 s here; the margin is for a loaded machine.
DEADLINE_S = 150
#: A survivor's report: rank, error, when (Unix time), message.
REPORT = r"rank (\d) raised (\w+) after [\d.]+ s at ([\d.]+): (.*)"
#: torchrun's rendezvous port on the first host (each host has its own network: nothing else holds it).
RDZV_PORT = 29411

FORMS = {
    "srun": "srun -N 2 --ntasks-per-node=2 python -m tests.slurm._body {module} /tmp/data",
    "torchrun-per-node": (
        "srun -N 2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "
        "--rdzv-endpoint={head}:{port} --rdzv-id=two-nodes -m tests.slurm._body {module} /tmp/data"
    ),
}


def _launch(slurm: SlurmBed, form: str, module: str, deadline: int = DEADLINE_S) -> tuple[int, str]:
    command = FORMS[form].format(module=module, head=slurm.nodes[0][1], port=RDZV_PORT)
    argv = slurm.command(["timeout", "-k", "5", str(deadline), "bash", "-c", command])
    done = subprocess.run(argv, env=slurm.job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_launch_form_runs_the_package_on_two_nodes(slurm_two_nodes: SlurmBed, form: str) -> None:
    rc, out = _launch(slurm_two_nodes, form, "ignite_ext.distributed")
    assert rc == 1, f"{form}: exited with {rc}, not 1 (rank 0 raises); output:\n{out[-4000:]}"
    formed = sorted(re.findall(r"formed (\d) (\d) (\d)", out))
    assert [(r, w) for r, w, _ in formed] == [(str(r), "4") for r in range(4)], f"{form}:\n{out[-4000:]}"
    assert sorted(local for _, _, local in formed) == ["0", "0", "1", "1"], f"{form}:\n{out[-4000:]}"
    # Each node's /tmp is its own: one download per node, seen by both of its ranks.
    assert re.findall(r"downloads (\d)", out) == ["1"] * 4, f"{form}:\n{out[-4000:]}"
    assert "rank 0 raised ValueError: rank 0 cannot read its shard" in out, out[-4000:]
    for rank in (1, 2, 3):
        assert re.search(rf"rank {rank} raised RankFailedError: .*\[0\]", out), f"rank {rank}:\n{out[-4000:]}"


def test_plain_ignite_beside_on_two_nodes(slurm_two_nodes: SlurmBed) -> None:
    # What ignite 0.5.5 alone gives: the srun form runs, with no rank naming the failed one; one torchrun per node
    # is refused before the group forms. A refused agent leaves the other waiting: a short deadline.
    rc, out = _launch(slurm_two_nodes, "srun", "ignite.distributed", 60)
    assert rc != 0 and "RankFailedError" not in out and "formed 3 4" in out, out[-4000:]
    rc, out = _launch(slurm_two_nodes, "torchrun-per-node", "ignite.distributed", 60)
    assert rc != 0 and "formed" not in out, out[-4000:]
    assert re.search(r"inconsistent with equivalent SLURM env variable.*WORLD_SIZE: 4 vs 2", out), out[-4000:]


#: The lost-node job's heartbeat timeout, srun's --wait, and Slurm's node timeout there: Slurm alone would end the
#: job only once it declares the node down (a minute here; 300 s by default), the package's report within 1.5 T.
LOST_T_S, SRUN_WAIT_S, LOST_SLURMD_TIMEOUT_S = 5.0, 2, 60


def test_a_lost_node_ends_the_job_in_the_packages_time(tmp_path: Path) -> None:
    # Its own bed: the test cuts a node off for good.
    reason = unavailable() or _hosts.unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmBed(hosts=2, slurmd_timeout=LOST_SLURMD_TIMEOUT_S) as slurm:
        env = slurm.job_env(IGNITE_EXT_HEARTBEAT_TIMEOUT=str(LOST_T_S))
        srun = ["srun", "-N", "2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", f"--wait={SRUN_WAIT_S}"]
        body = [sys.executable, "-m", "tests.slurm._death_body", "lost"]
        argv = slurm.command(["timeout", "-k", "5", str(DEADLINE_S), *srun, *body])
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = Lines(proc)
        try:
            lines_until(lines, r"ready (\d)", 4, time.monotonic() + DEADLINE_S)
            time.sleep(1.0)  # every survivor waits in the block for rank 2
            assert slurm.hosts is not None
            cut_at, cut = time.time(), time.monotonic()
            slurm.hosts.hosts[1].cut()
            out = lines.rest(time.monotonic() + DEADLINE_S)
            ended = lines.came[-1] - cut
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    reports = {int(m[1]): (m[2], float(m[3]) - cut_at, m[4]) for m in re.finditer(REPORT, out)}
    assert sorted(reports) == [0, 1], out[-4000:]
    for rank, (kind, after, message) in reports.items():
        assert kind == "RankFailedError" and "[2, 3]" in message, f"rank {rank}: {message}"
        assert after < 1.5 * LOST_T_S + 1, f"rank {rank} reported the lost node {after:.1f} s after the cut"
    # srun ends SRUN_WAIT_S after the survivors exit, then waits KillWait for the lost tasks (and as long again):
    # the job's end is the package's detection plus srun's options, not Slurm's node timeout.
    bound = 2 * LOST_T_S + SRUN_WAIT_S + 2 * KILL_WAIT_S + 5
    assert ended < bound < LOST_SLURMD_TIMEOUT_S, f"the job ended {ended:.1f} s after the cut:\n{out[-4000:]}"
