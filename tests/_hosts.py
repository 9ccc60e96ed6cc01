"""Simulated hosts on this machine, each with its own network, hostname, ``/tmp``, ``/dev/shm`` and processes.

A :class:`HostBed` of ``n`` hosts is made by the test itself, and always torn down:

* A **host** is one ``unshare --net --uts --mount --pid --fork --mount-proc`` process. Its init (``sh``, PID 1 of
  the host's PID namespace) sets the host up and then waits on a pipe from this process: a hostname of its own,
  private tmpfs ``/tmp`` and ``/dev/shm``, an ``/etc/hosts`` naming every host of the bed (and a resolver on its
  own loopback, which refuses: no query leaves the bed), and the bed's shared
  directory bind-mounted at the path given for that host. Its network namespace has its own loopback and one
  veth pair to the bed's bridge, ``eth0`` with ``10.77.0.<k+1>/24``. Killing that init kills every process of
  the host at once (the kernel does it: torchrun's workers run in sessions of their own, so no process group
  would reach them all), and so does the end of the pipe, should this process die.
* **Commands** enter a host through ``nsenter`` (:meth:`Host.start`); ``tests.hosts._jobs`` runs torchrun jobs
  (one agent per host, ``--master_addr`` being host 0's address) and an HTTP server on them.
* **Faults**: :meth:`Host.kill` (the whole host, all its processes), :meth:`Host.cut` (its link set down).
* **Teardown** (:meth:`HostBed.close`, which the fixtures call also when a test fails or times out) kills every
  host's init, waits for its launcher, deletes the veth links and the bridge. The mounts lived in the hosts'
  mount namespaces and end with them. Each bed has a unique name prefix (``ietb`` and five hex digits),
  registered under ``/run/ignite_ext_hosts`` with its owner's pid: :func:`sweep` (run before every new bed)
  removes what a crashed run left (its links and host processes) and never touches the bed of a live run.

Every bed uses the same subnet: a bed's hosts see nothing but their own bridge, and no address is added to this
machine's namespace, so beds of concurrent runs cannot meet, and no traffic leaves the sandbox.

``python -m tests._hosts`` sweeps leftovers and says whether hosts can be simulated here (exit status 1 and the
reason when they cannot) and whether the network filesystem of ``tests/hosts/_remote.py`` can be mounted;
``scripts/test.sh`` runs it and exports the reason in ``IGNITE_EXT_HOSTS_UNAVAILABLE``, with which the tests of
``tests/hosts`` skip.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RUN_ROOT",
    "UNAVAILABLE_ENV",
    "Host",
    "HostBed",
    "links",
    "sweep",
    "unavailable",
]

ROOT = Path(__file__).resolve().parents[1]
RUN_ROOT = Path("/run/ignite_ext_hosts")
UNAVAILABLE_ENV = "IGNITE_EXT_HOSTS_UNAVAILABLE"
_PREFIX = "ietb"
_LINK_RE = re.compile(r"^(ietb[0-9a-f]{5})(br|v\d+)$")
_SUBNET = "10.77.0"
_SETUP_TIMEOUT = 30.0


def _ip(*args: str, stdin: str | None = None, netns_of: int | None = None) -> None:
    cmd = ["ip", *args] if netns_of is None else ["nsenter", f"--target={netns_of}", "--net", "ip", *args]
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=_SETUP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: {done.stderr.strip()}")


def links(prefix: str = _PREFIX) -> list[str]:
    """The names of this namespace's network links that start with ``prefix``."""
    listing = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=_SETUP_TIMEOUT)
    names = (line.split(": ", 2)[1].split("@", 1)[0] for line in listing.stdout.splitlines() if ": " in line)
    return [name for name in names if name.startswith(prefix)]


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot), which tells it from a later process with its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _stamp(pid: int) -> str:
    return f"{pid} {_start_time(pid)}"


def _still_running(stamp: str) -> int | None:
    """The pid of a :func:`_stamp`, if that very process still runs."""
    pid, start = stamp.split()
    return int(pid) if _start_time(int(pid)) == start else None


def sweep() -> list[str]:
    """Remove what crashed runs left: the links and host processes of every bed whose owner is gone.

    Returns the prefixes removed.
    """
    removed, live = [], set()
    for entry in sorted(RUN_ROOT.glob(f"{_PREFIX}*")) if RUN_ROOT.is_dir() else []:
        owner = entry / "owner"
        if owner.exists() and _still_running(owner.read_text()) is not None:
            live.add(entry.name)
            continue
        keepers = entry / "keepers"
        for stamp in keepers.read_text().splitlines() if keepers.exists() else []:
            pid = _still_running(stamp)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    for name in links():
        match = _LINK_RE.match(name)
        if match and match.group(1) not in live:
            with contextlib.suppress(RuntimeError):  # gone meanwhile (a veth goes with its peer)
                _ip("link", "del", name)
            if match.group(1) not in removed:
                removed.append(match.group(1))
    return removed


@dataclass
class Host:
    """One simulated host of a :class:`HostBed`."""

    index: int
    name: str  # its hostname
    ip: str
    veth: str  # this namespace's end of its link
    shared: Path  # where it sees the bed's shared directory
    keeper: subprocess.Popen[bytes]  # the unshare process
    init: int  # PID 1 of the host's PID namespace, as this namespace numbers it

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its namespaces, in the repository)."""
        return ["nsenter", f"--target={self.init}", "--net", "--uts", "--mount", "--pid", f"--wd={ROOT}", "--", *argv]

    def start(self, argv: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this host, its output appended to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.command(argv), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

    def run(self, argv: Sequence[str], timeout: float = _SETUP_TIMEOUT) -> str:
        """Run ``argv`` in this host and return its output; fail when it fails."""
        done = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} on {self.name}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def pids(self) -> list[int]:
        """Every process of this host (its init included), as this namespace numbers them."""
        try:
            ns = os.readlink(f"/proc/{self.init}/ns/pid")
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        found.append(int(entry))
        return found

    def kill(self) -> None:
        """SIGKILL the host's init: the kernel then kills every process of the host."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init, signal.SIGKILL)

    def cut(self) -> None:
        """Set the host's link down: its processes live on, but nothing reaches them nor leaves them."""
        _ip("link", "set", self.veth, "down")

    def filter_port(self, port: int) -> None:
        """Drop every TCP packet that reaches this host for ``port`` from the bed, as a firewall does: no answer.

        A policy-routing rule that routes such packets to a blackhole, placed before the local table's rule (which
        moves behind it), so that a connection to the port from another host gets no reply, not even a reset, and
        the host's own connections to it (loopback) and every other port work as before.
        """
        rules = (
            "rule add pref 100 lookup local\nrule del pref 0\n"
            f"rule add pref 50 iif eth0 ipproto tcp dport {port} blackhole\n"
        )
        _ip("-batch", "-", stdin=rules, netns_of=self.init)

    def sees(self, path: Path, bed: HostBed) -> Path:
        """Where this host sees ``path``, a path under the bed's shared directory."""
        return self.shared / path.relative_to(bed.shared)


class HostBed:
    """``n`` simulated hosts on one bridge, sharing one directory; see the module docstring.

    Args:
        n: number of hosts.
        shared: an existing directory, bind-mounted into every host.
        logs: where the hosts' and commands' output goes (created).
        shared_at: for each host, where it sees ``shared`` (``None``: at the same path); a path under ``/tmp``,
            whose tmpfs is the host's own, so that nothing is created outside the host.
        tmpfs_mb: size limit of each host's ``/tmp`` and ``/dev/shm``.
    """

    def __init__(
        self,
        n: int,
        shared: Path,
        logs: Path,
        shared_at: Sequence[str | None] = (),
        tmpfs_mb: int = 256,
    ) -> None:
        sweep()
        self.shared, self.logs, self.tmpfs_mb = shared.resolve(), logs, tmpfs_mb
        self.logs.mkdir(parents=True, exist_ok=True)
        self.prefix = _PREFIX + secrets.token_hex(3)[:5]
        self.bridge = f"{self.prefix}br"
        self.hosts: list[Host] = []
        self._keepers: list[subprocess.Popen[bytes]] = []
        self._launched: list[subprocess.Popen[bytes]] = []
        self.jobs = 0  # torchrun jobs started (tests.hosts._jobs)
        # Registered before anything exists, by a rename, so that a sweep never sees a bed without its owner.
        RUN_ROOT.mkdir(parents=True, exist_ok=True)
        pending = RUN_ROOT / f".{self.prefix}"
        pending.mkdir()
        (pending / "owner").write_text(_stamp(os.getpid()))
        self.dir = RUN_ROOT / self.prefix
        pending.rename(self.dir)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            names = [(f"{_SUBNET}.{k + 1}", f"{self.prefix}-h{k}") for k in range(n)]
            hosts_file = self.dir / "hosts"
            hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for ip, name in names))
            # Names are resolved from /etc/hosts only: a query to the machine's resolver is traffic outside the bed,
            # and a TCPStore server resolves each connecting client's name in its only thread, so a resolver that
            # does not answer froze the store for seconds. The host's own loopback refuses the query at once.
            (self.dir / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            for k, (ip, name) in enumerate(names):
                at = shared_at[k] if k < len(shared_at) else None
                self.hosts.append(self._host(k, name, ip, Path(at) if at else self.shared, hosts_file))
        except BaseException:
            self.close()
            raise

    def _host(self, k: int, name: str, ip: str, at: Path, hosts_file: Path) -> Host:
        if at != self.shared and not at.is_relative_to("/tmp"):
            raise ValueError(f"host {k} would see the shared directory at {at}: only paths under /tmp are private")
        stage = self.dir / f"stage{k}"
        stage.mkdir()
        q = shlex.quote
        tmpfs = f"-t tmpfs -o size={self.tmpfs_mb}m,mode=1777 tmpfs"
        # A checkout (and its venv) under /tmp stays visible in the host: bound aside before /tmp is replaced.
        keep_root = ROOT.is_relative_to("/tmp")
        root_stage = self.dir / f"root{k}"
        if keep_root:
            root_stage.mkdir()
        script = "\n".join(
            [
                "set -e",
                f"hostname {q(name)}",
                f"mount --bind {q(str(self.shared))} {q(str(stage))}",  # first: it may live under /tmp
                *([f"mount --bind {q(str(ROOT))} {q(str(root_stage))}"] if keep_root else []),
                f"mount {tmpfs} /tmp",
                f"mount {tmpfs} /dev/shm",
                *(
                    [f"mkdir -p {q(str(ROOT))}", f"mount --move {q(str(root_stage))} {q(str(ROOT))}"]
                    if keep_root
                    else []
                ),
                f"mkdir -p {q(str(at))}",
                f"mount --move {q(str(stage))} {q(str(at))}",
                f"mount --bind {q(str(hosts_file))} /etc/hosts",
                f"mount --bind {q(str(hosts_file.parent / 'resolv.conf'))} /etc/resolv.conf || true",
                "echo ready",
                "read _ || true",  # until this process closes the pipe, or dies
            ]
        )
        unshare = [
            "unshare",
            "--net",
            "--uts",
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
        ]
        with open(self.logs / f"host{k}.setup.log", "wb") as err:
            keeper = subprocess.Popen(
                [*unshare, "--kill-child", "--", "sh", "-c", script],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._keepers.append(keeper)
        assert keeper.stdout is not None
        ready, _, _ = select.select([keeper.stdout], [], [], _SETUP_TIMEOUT)
        line = keeper.stdout.readline() if ready else b""
        children = Path(f"/proc/{keeper.pid}/task/{keeper.pid}/children")
        init = int(children.read_text().split()[0]) if line == b"ready\n" and children.exists() else 0
        if not init:
            keeper.kill()
            keeper.wait()
            problem = (self.logs / f"host{k}.setup.log").read_text().strip()
            raise RuntimeError(f"host {k} did not come up: {problem or 'no output'}")
        with open(self.dir / "keepers", "a") as keepers:
            keepers.write(f"{_stamp(keeper.pid)}\n{_stamp(init)}\n")
        veth, peer = f"{self.prefix}v{k}", f"{self.prefix}p{k}"
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer, "netns", str(init))
        _ip("link", "set", veth, "master", self.bridge, "up")
        setup = f"link set {peer} name eth0\naddr add {ip}/24 dev eth0\nlink set eth0 up\nlink set lo up\n"
        _ip("-batch", "-", stdin=setup, netns_of=init)
        return Host(k, name, ip, veth, at, keeper, init)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of commands in the hosts: this one, with the repository importable."""
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TMPDIR": "/tmp",  # the host's own
            **extra,
        }

    def start(self, host: Host, argv: Sequence[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host``; the bed kills it on closing."""
        proc = host.start(argv, env, self.logs / log)
        self._launched.append(proc)
        return proc

    def close(self) -> None:
        """Kill every host and everything started in it; delete the links, the bridge and the registration."""
        for keeper in self._keepers:
            with contextlib.suppress(OSError, ValueError):
                assert keeper.stdin is not None
                keeper.stdin.close()
        for host in self.hosts:
            host.kill()
        for proc in [*self._keepers, *self._launched]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for name in links(self.prefix):
            with contextlib.suppress(RuntimeError):  # a veth goes with its peer's namespace
                _ip("link", "del", name)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> HostBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def unavailable() -> str | None:
    """Why hosts cannot be simulated here (None when they can): the exported reason, or a one-host probe's."""
    reason = os.environ.get(UNAVAILABLE_ENV)
    if reason:
        return reason
    if sys.platform != "linux":
        return f"simulated hosts need Linux namespaces, not {sys.platform}"
    if os.geteuid() != 0:
        return "simulated hosts need root (network, UTS, mount and PID namespaces, veth links, a bridge)"
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (util-linux, iproute2)"
    probe = Path("/tmp") / f"ignite_ext_hosts_probe_{os.getpid()}"
    try:
        probe.mkdir(exist_ok=True)
        with HostBed(1, probe, probe / "logs") as bed:
            seen = bed.hosts[0].run(["sh", "-c", "hostname; ip -o -4 addr show eth0"])
        if bed.hosts[0].name not in seen or bed.hosts[0].ip not in seen:
            return f"a simulated host does not have its own hostname and address: {seen.strip()}"
    except Exception as exc:
        return f"cannot make a simulated host: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def main() -> int:
    swept = sweep() if os.geteuid() == 0 and shutil.which("ip") else []
    reason = unavailable()
    if reason:
        print(reason)
        return 1
    from tests.hosts._remote import remote_unavailable  # it builds on this module

    left = f"; swept leftovers of earlier runs: {', '.join(swept)}" if swept else ""
    remote = remote_unavailable()
    network_fs = f"; !!! the network filesystem test will skip: {remote}" if remote else ""
    print(f"simulated hosts available (network, UTS, mount and PID namespaces){left}{network_fs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
