"""SharedPath over real gloo ranks: grouping by physical directory, failures, cleanup, and two nodes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ignite_ext.distributed as idist
from benchmarks.bench_census import counting_fs_ops
from ignite_ext.distributed.shared_path import MARKER_PREFIX
from tests._world import World, free_port
from tests.backends._bodies import observe

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def body_shared(paths: list[str], failing: int | None = None) -> dict[str, Any]:
    rank = idist.get_rank()
    probe = Path(paths[rank]) / "probe"

    def block(turn: Any) -> None:
        if turn:
            time.sleep(0.3)
            if rank == failing:
                raise OSError(f"download failed on rank {rank}")
            probe.write_text(str(rank))

    seen = observe(block, lambda: idist.rank_scheduler(order=idist.SharedPath(paths[rank])))
    seen["probe"] = probe.read_text() if probe.exists() else None
    return seen


def body_mismatched_policy(path: str) -> dict[str, Any]:
    order = idist.MasterFirst() if idist.get_rank() == 3 else idist.SharedPath(path)
    return observe(lambda t: None, lambda: idist.rank_scheduler(order=order))


def body_group(path: str) -> list[int]:
    with idist.rank_scheduler(order=idist.SharedPath(path)) as turn:
        return list(turn.group)


def markers(*dirs: Path) -> list[str]:
    return [p.name for d in dirs if d.exists() for p in d.iterdir() if p.name.startswith(MARKER_PREFIX)]


def test_two_directories_make_two_groups(world: World, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"  # created by SharedPath
    seen = world(body_shared, [str(a), str(a), str(b), str(b)])
    assert [s["outcome"] for s in seen] == ["ok"] * 4
    assert [s["first"] for s in seen] == [True, False, True, False]
    assert [s["leader"] for s in seen] == [0, 0, 2, 2]
    assert seen[1]["start"] >= seen[0]["end"] and seen[3]["start"] >= seen[2]["end"]
    assert seen[2]["start"] < seen[0]["end"], "the two leaders should run in parallel"
    assert [s["probe"] for s in seen] == ["0", "0", "2", "2"]
    assert markers(a, b) == []


def test_symlink_is_the_same_directory(world: World, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    seen = world(body_shared, [str(real), str(link), str(link), str(real)])
    assert [s["first"] for s in seen] == [True, False, False, False]
    assert all(s["start"] >= seen[0]["end"] for s in seen[1:])
    assert markers(real) == []


def test_serial_groups_alone(tmp_path: Path) -> None:
    with idist.rank_scheduler(order=idist.SharedPath(tmp_path / "new" / "dir")) as turn:
        assert turn and turn.group == (0,) and turn.leader == 0
    assert (tmp_path / "new" / "dir").is_dir()


def test_leader_failure_reaches_its_group(world: World, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    seen = world(body_shared, [str(a), str(a), str(b), str(b)], 2)
    assert seen[2]["outcome"] == "OSError"
    assert seen[3]["outcome"] == "RankFailedError" and not seen[3]["ran"]
    assert seen[3]["failures"] == [(2, "OSError", "download failed on rank 2")]
    # The other group ran, and learns of the failure when it leaves the block.
    assert seen[0]["ran"] and seen[1]["ran"]
    assert seen[0]["outcome"] == seen[1]["outcome"] == "RankFailedError"
    assert markers(a, b) == []


@pytest.mark.parametrize("bad", ["file", "unusable"])
def test_unusable_path_on_one_rank_is_an_error_everywhere(world: World, tmp_path: Path, bad: str) -> None:
    good = tmp_path / "good"
    if bad == "file":
        target = tmp_path / "not_a_dir"
        target.write_text("x")
    else:
        target = Path("/proc/self/ignite_ext_cannot_create_here")
    seen = world(body_shared, [str(good), str(good), str(target), str(good)])
    assert [s["outcome"] for s in seen] == ["ValueError"] * 4
    assert all("rank(s) [2]" in s["message"] for s in seen), seen[0]["message"]
    assert not any(s["ran"] for s in seen)
    assert markers(good) == []


def test_mismatched_policy_types_are_a_value_error(world: World, tmp_path: Path) -> None:
    seen = world(body_mismatched_policy, str(tmp_path))
    assert [s["outcome"] for s in seen] == ["ValueError"] * 4
    assert "different rank_scheduler arguments" in seen[0]["message"]


def test_census_ignores_stale_directory_listings(world: World, tmp_path: Path) -> None:
    # Markers are looked up by exact, fresh names, so a directory full of other entries (or a stale listing)
    # cannot confuse the census: repeated use keeps giving the same single group.
    for i in range(50):
        (tmp_path / f"{MARKER_PREFIX}stale-{i}").write_text("")
    for _ in range(2):
        assert world(body_group, str(tmp_path)) == [[0, 1, 2, 3]] * 4


# ----------------------------------------------------------------------------------- two nodes via torchrun


def _can_unshare() -> str:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return "" if probe.returncode == 0 else f"mount namespaces not permitted here: {probe.stderr.strip()}"


def _launch_nodes(node_local: Path, shared: Path, out: Path, private_tmpfs: bool) -> None:
    port = free_port()
    body = Path(__file__).with_name("torchrun_body.py")
    procs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    for node in range(2):
        torchrun = (
            f"exec {sys.executable} -m torch.distributed.run --nnodes=2 --nproc_per_node=2 --node_rank={node} "
            f"--master_addr=127.0.0.1 --master_port={port} {body} {node_local} {shared} {out}"
        )
        if private_tmpfs:
            # Each simulated node gets its own mount namespace with a private tmpfs at the *same* path.
            cmd = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                f"mount -t tmpfs -o size=16m tmpfs {node_local} && {torchrun}",
            ]
        else:
            cmd = ["sh", "-c", torchrun]
        procs.append(
            subprocess.Popen(
                cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    deadline = time.monotonic() + 150
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        logs = []
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            logs.append(p.stdout.read() if p.stdout else "")
    assert all(p.returncode == 0 for p in procs), "\n\n".join(logs)


@pytest.mark.multinode
def test_two_nodes_under_torchrun(tmp_path: Path) -> None:
    reason = _can_unshare()
    node_local = tmp_path / "node_local"
    node_local.mkdir()
    shared, out = tmp_path / "shared", tmp_path / "out"
    shared.mkdir()
    out.mkdir()
    _launch_nodes(node_local, shared, out, private_tmpfs=not reason)
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [s["node"] for s in seen] == [0, 0, 1, 1] and [s["local_rank"] for s in seen] == [0, 1, 0, 1]

    # MasterFirst(local=True): local rank 0 of each node first, the nodes in parallel.
    m = [s["master_local"] for s in seen]
    assert [x["first"] for x in m] == [True, False, True, False]
    assert m[1]["start"] >= m[0]["end"] and m[3]["start"] >= m[2]["end"]
    assert m[2]["start"] < m[0]["end"], "node leaders should overlap"

    # Ordered(local=True): one at a time within each node, nodes in parallel.
    o = [s["ordered_local"] for s in seen]
    assert o[1]["start"] >= o[0]["end"] and o[3]["start"] >= o[2]["end"]
    assert o[2]["start"] < o[0]["end"]

    # SharedPath on a directory both nodes see: one leader for the cluster.
    c = [s["shared_all"] for s in seen]
    assert [x["first"] for x in c] == [True, False, False, False]
    assert [x["probe"] for x in c] == ["0"] * 4

    if reason:
        pytest.skip(f"node-local directories not simulated ({reason}); the rest passed")
    # The same path string, node-local on each node: one leader per node, each node's own file.
    n = [s["shared_local"] for s in seen]
    assert [x["first"] for x in n] == [True, False, True, False]
    assert [x["group"] for x in n] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [x["probe"] for x in n] == ["0", "0", "2", "2"]
    assert markers(shared / "data") == []


# ------------------------------------------------------------------------------------------- cost and hosts


def body_census_cost(path: str) -> dict[str, int]:
    with counting_fs_ops() as counts, idist.rank_scheduler(order=idist.SharedPath(path)):
        pass
    return counts


@pytest.mark.parametrize("nprocs", [2, 6])
def test_the_census_costs_a_few_filesystem_operations_per_rank_whatever_the_world(
    world: World, tmp_path: Path, nprocs: int
) -> None:
    counts = world(body_census_cost, str(tmp_path), nprocs=nprocs, deadline=90)
    totals = [sum(c.values()) for c in counts]
    assert max(totals) <= 16, counts  # the host leader: mkdir, stats, its file, the link, the cleanup
    assert max(totals[1:]) <= 8, counts  # the others: mkdir and a few stats, and not one lookup per rank
    assert all(c["listdir"] == c["scandir"] == 0 for c in counts)


def _set_hostname(name: str) -> str:
    """Give this process a UTS namespace of its own with ``name`` as hostname ("" when that is not allowed)."""
    import ctypes
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x04000000) != 0:  # CLONE_NEWUTS
        return f"unshare(CLONE_NEWUTS): {os.strerror(ctypes.get_errno())}"
    raw = name.encode()
    if libc.sethostname(raw, len(raw)) != 0:
        return f"sethostname: {os.strerror(ctypes.get_errno())}"
    assert socket.gethostname() == name
    return ""


def body_hosts(shared: str, own: str) -> dict[str, Any]:
    problem = _set_hostname(f"simhost{idist.get_rank() // 2}")  # two simulated hosts of two ranks each
    if problem:
        return {"skip": problem}
    out: dict[str, Any] = {}
    for name, path in (("shared", shared), ("own", f"{own}/{idist.get_rank() // 2}")):
        with idist.rank_scheduler(order=idist.SharedPath(path)) as turn:
            out[name] = (bool(turn), list(turn.group))
    return out


def test_ranks_on_different_hosts_meet_on_the_shared_directory(world: World, tmp_path: Path) -> None:
    # Each rank renames its host (a UTS namespace of its own), so the census must go through the filesystem
    # rendezvous: one leader for the directory all share, one per host for the directories of each host.
    seen = world(body_hosts, str(tmp_path / "shared"), str(tmp_path / "own"), deadline=90)
    if any("skip" in s for s in seen):
        pytest.skip(seen[0].get("skip", "no UTS namespaces"))
    assert [s["shared"] for s in seen] == [(r == 0, [0, 1, 2, 3]) for r in range(4)]
    assert [s["own"] for s in seen] == [(True, [0, 1]), (False, [0, 1]), (True, [2, 3]), (False, [2, 3])]
    assert markers(tmp_path / "shared", tmp_path / "own" / "0", tmp_path / "own" / "1") == []
