"""The simulated hosts themselves: isolated from each other and from this machine, and always torn down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._hosts import ROOT, RUN_ROOT, UNAVAILABLE_ENV, HostBed, links, sweep, unavailable
from tests.hosts.conftest import make_bed

pytestmark = [pytest.mark.distributed, pytest.mark.multinode, pytest.mark.timeout(120)]

# Connects to HOST:PORT and prints what happened: "ok", or the error's name (no torch: starts in milliseconds).
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except OSError as exc:
    print(type(exc).__name__, exc)
"""
# Listens on HOST:PORT for a while.
LISTEN = "import socket, sys, time; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); time.sleep(60)"


def connect(bed: HostBed, k: int, host: str, port: int, timeout: float = 2.0) -> str:
    return bed.hosts[k].run([sys.executable, "-c", CONNECT, host, str(port), str(timeout)]).strip()


def listening(bed: HostBed, k: int, host: str, port: int) -> None:
    proc = bed.start(bed.hosts[k], [sys.executable, "-c", LISTEN, host, str(port)], bed.env(), f"listen{port}.log")
    end = time.monotonic() + 10
    while f":{port:04X} " not in bed.hosts[k].run(["cat", "/proc/net/tcp"]):
        assert proc.poll() is None and time.monotonic() < end, (bed.logs / f"listen{port}.log").read_text()
        time.sleep(0.02)


def mounts() -> str:
    return Path("/proc/self/mounts").read_text()


def test_hosts_have_their_own_names_files_and_network(bed2: HostBed) -> None:
    bed = bed2
    h0, h1 = bed.hosts
    assert [h.run(["hostname"]).strip() for h in bed.hosts] == [h0.name, h1.name]
    assert os.uname().nodename not in (h0.name, h1.name)
    h1.run(["sh", "-c", "echo x > /tmp/mine && echo y > /dev/shm/mine && echo z > " + str(h1.shared / "theirs")])
    absent = "test ! -e /tmp/mine && test ! -e /dev/shm/mine && echo absent"
    assert h0.run(["sh", "-c", absent]).strip() == "absent", "host 0 sees host 1's files"
    assert not Path("/tmp/mine").exists() and not Path("/dev/shm/mine").exists()
    assert (bed.shared / "theirs").read_text() == "z\n", "the shared directory is shared"
    # Each host resolves the others by name, and reaches them only through the bridge.
    assert h1.run(["getent", "hosts", h0.name]).split() == [h0.ip, h0.name]
    listening(bed, 0, h0.ip, 7000)
    listening(bed, 0, "127.0.0.1", 7001)
    assert connect(bed, 1, h0.name, 7000) == "ok"
    assert connect(bed, 1, "127.0.0.1", 7001).startswith("ConnectionRefusedError"), "loopback is the host's own"
    assert connect(bed, 0, "127.0.0.1", 7001) == "ok"
    assert connect(bed, 1, "192.0.2.1", 80).startswith("OSError [Errno 101]"), "nothing outside the bed is reachable"
    assert "10.77.0." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    h1.cut()
    assert connect(bed, 1, h0.ip, 7000, timeout=1.0).startswith(("TimeoutError", "OSError [Errno 113]"))


def test_teardown_removes_processes_links_and_mounts_even_when_the_test_fails(tmp_path: Path) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    (tmp_path / "shared").mkdir()
    with (
        pytest.raises(RuntimeError, match="the test failed"),
        HostBed(2, tmp_path / "shared", tmp_path / "logs") as bed,
    ):
        for host in bed.hosts:
            bed.start(host, ["sleep", "600"], bed.env(), "sleep.log")
        end = time.monotonic() + 10
        while sum(len(h.pids()) for h in bed.hosts) < 4 and time.monotonic() < end:  # an init and a sleep each
            time.sleep(0.02)
        pids = [pid for h in bed.hosts for pid in h.pids()]
        assert len(pids) == 4 and len(links(bed.prefix)) == 3  # the bridge, a veth per host
        raise RuntimeError("the test failed")
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert links(bed.prefix) == []
    assert not (RUN_ROOT / bed.prefix).exists()
    assert str(tmp_path) not in mounts()


@pytest.fixture
def crashed(tmp_path: Path) -> Iterator[tuple[str, list[int]]]:
    """A bed made by a process that was then SIGKILLed (a crashed test run): its prefix and its hosts' inits."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    (tmp_path / "shared").mkdir()
    code = (
        "import sys, time; from pathlib import Path; from tests._hosts import HostBed; "
        f"bed = HostBed(2, Path({str(tmp_path / 'shared')!r}), Path({str(tmp_path / 'logs')!r})); "
        "print(bed.prefix, *(h.init for h in bed.hosts), flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    prefix, *inits = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        yield prefix, [int(pid) for pid in inits]
    finally:
        sweep()


def test_a_crashed_runs_hosts_end_with_it_and_the_next_sweep_removes_the_rest(crashed: tuple[str, list[int]]) -> None:
    prefix, inits = crashed
    # The hosts' inits wait on a pipe from their maker: its death ends them, and their namespaces with them.
    end = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in inits) and time.monotonic() < end:
        time.sleep(0.02)
    assert [pid for pid in inits if Path(f"/proc/{pid}").exists()] == [], "a host outlived the run that made it"
    assert f"{prefix}br" in links(prefix) and (RUN_ROOT / prefix).exists()  # what is left to sweep
    assert prefix in sweep()
    assert links(prefix) == [] and not (RUN_ROOT / prefix).exists()


def test_a_sweep_leaves_a_live_bed_alone(bed2: HostBed) -> None:
    assert bed2.prefix not in sweep()
    assert len(links(bed2.prefix)) == 3
    assert bed2.hosts[1].run(["hostname"]).strip() == bed2.hosts[1].name


def test_without_namespaces_the_tests_skip_with_the_reason_and_the_probe_says_so(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = "no namespaces in this container (probe)"
    monkeypatch.setenv(UNAVAILABLE_ENV, reason)
    unavailable.cache_clear()
    try:
        with pytest.raises(pytest.skip.Exception, match=r"no namespaces in this container \(probe\)"):
            make_bed(request, tmp_path, 2)
    finally:
        unavailable.cache_clear()
    probe = subprocess.run([sys.executable, "-m", "tests._hosts"], cwd=ROOT, capture_output=True, text=True)
    assert (probe.returncode, probe.stdout.strip()) == (1, reason)


TIMED_OUT = """
import os, time
from pathlib import Path

import pytest

from tests.hosts.conftest import make_bed


@pytest.mark.timeout(30)  # making the bed takes seconds on a loaded machine; the test then sleeps past it
def test_runs_past_its_timeout(request, tmp_path):
    bed = make_bed(request, tmp_path, 2)
    Path(os.environ["BED_REPORT"]).write_text(" ".join([bed.prefix, *(str(h.init) for h in bed.hosts)]))
    time.sleep(120)
"""


def test_a_test_that_times_out_still_tears_its_hosts_down(tmp_path: Path) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    (tmp_path / "test_timed_out.py").write_text(TIMED_OUT)
    report = tmp_path / "bed.txt"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_timed_out.py")],
        cwd=ROOT,
        env={**os.environ, "BED_REPORT": str(report), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 1 and "Timeout" in run.stdout, run.stdout[-3000:]
    prefix, *inits = report.read_text().split()
    assert links(prefix) == [] and not (RUN_ROOT / prefix).exists()
    assert [pid for pid in inits if Path(f"/proc/{pid}").exists()] == []
