"""The real torchrun across simulated hosts: a restarted group re-forms on a store of its own, after a lost host.

Three hosts, one rank each, one torchrun agent per host with torch's c10d rendezvous (served by host 0's agent,
``--nnodes=2:3``, ``--max-restarts=1``). Every rank runs a block and waits in a gloo barrier; the test kills host 2
whole (its PID namespace's init: its agent and rank die at once). The survivors fail in the barrier, their agents
restart them, and the rendezvous goes on with the two hosts left. The restarted group must form and run its block
as a first attempt does: its store is named by the rendezvous round (the agents' restart counts need not agree),
so nothing of the failed attempt (gloo's peer addresses, the scheduler's keys) is read. Each host's node cache
(``CachedDataset(scope="node")``, filled in the first attempt) is kept by its failing rank for the restart, adopted
by it (no sample loaded again), and gone from the host's ``/dev/shm`` after the last attempt. The same with torchrun's
default static rendezvous across two hosts, a rank failing by an exception.
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
    from ignite_ext.data import CachedDataset
    from ignite_ext.distributed.store.incarnation import incarnation

    out, mode = sys.argv[1], sys.argv[2]
    first = not os.path.exists(os.path.join(out, "failed"))  # written before the first attempt fails
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
    cache = CachedDataset([bytes([i]) * 1024 for i in range(SAMPLES)], scope="node")  # each host's own
    assert all(cache[i] == bytes([i]) * 1024 for i in range(SAMPLES))  # every rank reads every sample
    when, segment = "first" if first else "again", os.path.basename(cache.segment)
    say(f"{said}: {when} loads {cache.stats().misses} segment {segment}")
    if first:
        open(os.path.join(out, f"ready.{rank}"), "w").close()
        if mode == "raise" and rank == 1:
            while not os.path.exists(os.path.join(out, "ready.0")):
                time.sleep(0.1)
            open(os.path.join(out, "failed"), "w").close()
            raise RuntimeError("rank 1 fails in the first attempt")
        while True:  # until a peer fails or its host is lost: the barrier fails, the agent restarts this rank
            idist.barrier()
            time.sleep(0.2)
    cache.close()
    idist.finalize()
    say(f"{said}: done")
    """
).replace("SAMPLES", "64")


def _said(out: Path) -> str:
    return "".join(p.read_text() for p in sorted(out.glob("said.*")))


def _job(bed: HostBed, hosts: int, how: str) -> tuple[str, str, list[subprocess.Popen[bytes]]]:
    """One agent per host (the first ``hosts``), ranks that fail ``how``; what the ranks and agents said."""
    out = bed.shared / "restart"
    out.mkdir()
    (bed.shared / "job.py").write_text(SCRIPT)
    members = bed.hosts[:hosts]
    procs = []
    for host in members:
        if how == "lost-host":  # c10d, elastic: the job goes on with the hosts left
            rendezvous = ["--nnodes=2:3", "--rdzv-backend=c10d", f"--rdzv-endpoint={members[0].ip}:29400",
                          "--rdzv-id=lost-host", f"--rdzv-conf=is_host={int(host.index == 0)},last_call_timeout=2,"
                          "keep_alive_interval=1,keep_alive_max_attempt=2", f"--local-addr={host.ip}"]  # fmt: skip
        else:  # torchrun's default: static, each host's rank given
            rendezvous = [f"--nnodes={hosts}", f"--node-rank={host.index}", f"--master-addr={members[0].ip}",
                          "--master-port=29500", f"--local-addr={host.ip}"]  # fmt: skip
        argv = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node=1", "--max-restarts=1",
                "--monitor-interval=0.5", str(host.sees(bed.shared / "job.py", bed)), str(host.sees(out, bed)),
                "raise" if how == "raise" else "wait"]  # fmt: skip
        procs.append(bed.start(host, argv, bed.env(LOGLEVEL="WARNING"), f"agent{host.index}.log"))
    deadline = time.monotonic() + 120
    while len(list(out.glob("ready.*"))) < hosts:
        assert time.monotonic() < deadline, _said(out) + "".join(p.read_text() for p in bed.logs.glob("agent*"))
        assert all(p.poll() is None for p in procs), "".join(p.read_text() for p in bed.logs.glob("agent*"))
        time.sleep(0.2)
    if how == "lost-host":
        (out / "failed").touch()
        bed.hosts[hosts - 1].kill()
        procs = procs[:-1]
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=150)
    return _said(out), "".join(p.read_text()[-3000:] for p in sorted(bed.logs.glob("agent*"))), procs


@pytest.mark.parametrize(("hosts", "how"), [(3, "lost-host"), (2, "raise")])
def test_a_restarted_group_re_forms_across_hosts_and_runs_its_block(bed3: HostBed, hosts: int, how: str) -> None:
    said, logs, procs = _job(bed3, hosts, how)
    assert all(proc.returncode == 0 for proc in procs), said + logs
    world = len(procs)
    restarted = re.findall(rf"(\S+) count (\d) world {world} rank (\d): block in ([0-9.]+) s", said)
    restarted = restarted[-world:]  # the restarted attempt's (the first attempt's come first in each file)
    assert sorted(r for _, _, r, _ in restarted) == [str(r) for r in range(world)], said + logs
    assert len({name for name, _, _, _ in restarted}) == 1, said  # one store for the group
    assert all(float(s) < BLOCK_BOUND_S for _, _, _, s in restarted), said
    assert len(re.findall(rf"world {world} rank \d: done", said)) == world, said + logs
    # Each surviving host's node cache, left by the failed attempt, is adopted: nothing loaded after the restart.
    loads = re.findall(r"rank \d: (first|again) loads (\d+) segment (\S+)", said)
    assert [n for when, n, _ in loads if when == "first"] == ["64"] * hosts, said  # the first attempt loads
    assert [n for when, n, _ in loads if when == "again"] == ["0"] * world, said
    # And after the last attempt nothing of the job is left in any surviving host's /dev/shm.
    for host in bed3.hosts[:world]:
        left = host.run(["ls", "-A", "/dev/shm"]).split()
        assert not {segment for _, _, segment in loads} & set(left), (host.name, left)
    print(said)  # the names and each agent's restart count, for the record
