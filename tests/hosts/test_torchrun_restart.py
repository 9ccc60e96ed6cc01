"""The real torchrun across simulated hosts: a restarted group re-forms on a store of its own, after a lost host.

Three hosts, one rank each, one torchrun agent per host with torch's c10d rendezvous (served by host 0's agent,
``--nnodes=2:3``, ``--max-restarts=1``). Every rank runs a block and waits in a gloo barrier; the test kills host 2
whole (its PID namespace's init: its agent and rank die at once). The survivors fail in the barrier, their agents
restart them, and the rendezvous goes on with the two hosts left. The restarted group must form and run its block
as a first attempt does: its store is named by the rendezvous round (the agents' restart counts need not agree),
so nothing of the failed attempt (gloo's peer addresses, the scheduler's keys) is read.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._hosts import HostBed

pytestmark = [pytest.mark.distributed, pytest.mark.multinode, pytest.mark.timeout(300)]

BLOCK_BOUND_S = 15.0  # a first block costs well under a second here; the failure it guards against is for ever

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import ignite_ext.distributed as idist
    from ignite_ext.distributed.store.incarnation import incarnation

    out = sys.argv[1]
    def say(line):
        with open(os.path.join(out, f"said.{os.getpid()}"), "a") as f:
            f.write(line + "\\n")

    name = incarnation()
    idist.initialize("gloo", timeout=timedelta(seconds=20))
    rank, world = idist.get_rank(), idist.get_world_size()
    said = f"{name} count {os.environ['TORCHELASTIC_RESTART_COUNT']} world {world} rank {rank}"
    say(f"{said}: formed")
    start = time.monotonic()
    with idist.one_rank_first():
        pass
    say(f"{said}: block in {time.monotonic() - start:.2f} s")
    if world == 3:
        open(os.path.join(out, f"ready.{rank}"), "w").close()
        while True:  # until a peer's host is lost: the barrier fails, the agent restarts this rank
            idist.barrier()
            time.sleep(0.2)
    idist.finalize()
    say(f"{said}: done")
    """
)


def _said(out: Path) -> str:
    return "".join(p.read_text() for p in sorted(out.glob("said.*")))


def test_a_group_restarted_after_a_lost_host_re_forms_and_runs_its_block(bed3: HostBed) -> None:
    out = bed3.shared / "restart"
    out.mkdir()
    (bed3.shared / "job.py").write_text(SCRIPT)
    port = "29400"  # every host's network is its own
    procs = []
    for host in bed3.hosts:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={bed3.hosts[0].ip}:{port}", "--rdzv-id=lost-host",
                f"--rdzv-conf=is_host={int(host.index == 0)},last_call_timeout=2,keep_alive_interval=1,"
                "keep_alive_max_attempt=2", f"--local-addr={host.ip}", "--max-restarts=1", "--monitor-interval=0.5",
                str(host.sees(bed3.shared / "job.py", bed3)), str(host.sees(out, bed3))]  # fmt: skip
        procs.append(bed3.start(host, argv, bed3.env(LOGLEVEL="WARNING"), f"agent{host.index}.log"))
    deadline = time.monotonic() + 120
    while len(list(out.glob("ready.*"))) < 3:
        assert time.monotonic() < deadline, _said(out) + "".join(p.read_text() for p in bed3.logs.glob("agent*"))
        assert all(p.poll() is None for p in procs), "".join(p.read_text() for p in bed3.logs.glob("agent*"))
        time.sleep(0.2)
    bed3.hosts[2].kill()
    for proc in procs[:2]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=150)
    said = _said(out)
    logs = "".join(p.read_text()[-3000:] for p in sorted(bed3.logs.glob("agent*")))
    assert all(proc.returncode == 0 for proc in procs[:2]), said + logs
    restarted = re.findall(r"(\S+) count (\d) world 2 rank (\d): block in ([0-9.]+) s", said)
    assert sorted(r for _, _, r, _ in restarted) == ["0", "1"], said + logs
    assert len({name for name, _, _, _ in restarted}) == 1 and restarted[0][0].startswith("round-"), said
    assert all(float(s) < BLOCK_BOUND_S for _, _, _, s in restarted), said
    assert len(re.findall(r"world 2 rank \d: done", said)) == 2, said + logs
    print(said)  # the rounds and each agent's restart count, for the record
