"""A Slurm cluster of one node on this machine, made and torn down by the test that uses it.

A :class:`SlurmBed` starts, each in the foreground under this process:

* ``munged``, as the munge user, with a key, socket, seed and log of its own under the bed's directory (Slurm's
  daemons and commands authenticate through it: ``AuthInfo=socket=...``);
* ``slurmctld`` and one ``slurmd``, as root, with a ``slurm.conf`` of the bed's own (``SLURM_CONF``): the node is
  this machine's short hostname at ``127.0.0.1``, both daemons listen on free ports, state and spool live in the
  bed's directory. No systemd, no cgroups (``proctrack/linuxproc``, ``task/none``), no accounting.

:meth:`SlurmBed.close` cancels every job, kills the daemons (their process groups: whatever they started goes with
them) and removes the directory. A test run killed before that leaves them running: each new bed first kills
what such runs left (:func:`sweep_dead_beds`). :attr:`SlurmBed.env` is the environment for ``srun``, ``sbatch``
and the others.

``python -m tests._slurm`` says whether such a bed can be made here (exit status 1 and the reason when it cannot);
``scripts/test.sh`` runs it and exports the reason in ``IGNITE_EXT_SLURM_UNAVAILABLE``, with which the tests of
``tests/slurm`` skip.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.bench_failure_cost import requeued_after
from tests._hosts import HostBed, _stamp, _still_running
from tests._world import free_port

__all__ = ["KILL_WAIT_S", "UNAVAILABLE_ENV", "Lines", "SlurmBed", "lines_until", "sweep_dead_beds", "unavailable"]

UNAVAILABLE_ENV = "IGNITE_EXT_SLURM_UNAVAILABLE"
_ROOT = Path(__file__).resolve().parents[1]
_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "scancel", "sinfo")
_START_TIMEOUT_S = 30.0
#: Slurm's KillWait here: seconds between the SIGTERM and the SIGKILL that end a job's processes.
KILL_WAIT_S = 2
#: Seconds a requeued job waits under :meth:`SlurmBed.requeued_at_once`: two whole seconds past its revocation.
_REQUEUE_HOLD_S = 2.0
#: More CPUs than the machine has (``SlurmdParameters=config_overrides``): a few 2-rank jobs at once on 2 cores.
_CPUS = 8

_CONF = """\
ClusterName=ietest
FirstJobId={first_job_id}
SlurmctldHost={controller}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
ReturnToService=2
KillWait={kill_wait}
SlurmdTimeout={slurmd_timeout}
SlurmctldTimeout=10
MessageTimeout=10
InactiveLimit=0
MinJobAge=30
StateSaveLocation={root}/state
SlurmdSpoolDir={node_dir}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={node_dir}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


_PREFIX = "ignite_ext_slurm_"


def _bed_of(pid: int, beds: str) -> str | None:
    """The bed directory process ``pid`` belongs to: one of its open files, or its ``SLURM_CONF``, lies in it."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        found = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return None
    found += [v.decode(errors="replace") for v in environ if v.startswith(b"SLURM_CONF=")]
    for text in found:
        if (start := text.find(beds)) >= 0:
            return text[start:].split("/")[0]
    return None


def sweep_dead_beds() -> list[int]:
    """SIGKILL what the beds of killed test runs left: daemons, job steps and their tasks; the pids killed.

    A bed is dead when its directory is gone or the process that made it (``owner`` in it) no longer runs: a test
    run killed before its teardown leaves its daemons running, and its jobs' ``slurmstepd`` and tasks.
    """
    beds = os.path.join(tempfile.gettempdir(), _PREFIX)
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        name = _bed_of(int(entry.name), os.path.basename(beds))
        if name is None:
            continue
        owner = Path(beds).parent / name / "owner"
        try:
            alive = _still_running(owner.read_text()) is not None
        except (OSError, ValueError):
            alive = False
        if not alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


def unavailable() -> str | None:
    """Why a Slurm bed cannot be made here (None when it can): the exported reason, or what is missing."""
    reason = os.environ.get(UNAVAILABLE_ENV)
    if reason:
        return reason
    if sys.platform != "linux":
        return f"the Slurm test bed needs Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "the Slurm test bed needs root (slurmd starts jobs as their user; munged runs as the munge user)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the Slurm test bed needs {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the Slurm test bed needs the munge user (Debian's munge package makes it)"
    try:
        socket.gethostbyname(socket.gethostname().split(".")[0])
    except OSError as exc:
        return f"this machine's hostname does not resolve, and Slurm's node must: {exc}"
    return None


class SlurmBed:
    """One Slurm node on this machine: ``munged``, ``slurmctld`` and ``slurmd``, in a directory of their own."""

    def __init__(self, hosts: int = 0, slurmd_timeout: int = 10) -> None:
        self.slurmd_timeout = slurmd_timeout  # seconds before Slurm declares a silent node down
        sweep_dead_beds()
        self.root = Path(tempfile.mkdtemp(prefix=_PREFIX))
        self.root.chmod(0o755)  # munged refuses a socket directory others may write to, or cannot reach
        (self.root / "owner").write_text(_stamp(os.getpid()))
        self._daemons: list[subprocess.Popen[bytes]] = []
        self.hosts: HostBed | None = None
        try:
            if hosts:
                # One Slurm node per simulated host (tests._hosts): the bed's directory is their shared one, each
                # host's /tmp its own. Its daemons and commands run in the hosts; munged here (a Unix socket).
                self.hosts = HostBed(hosts, shared=self.root, logs=self.root / "hosts")
                self.nodes = [(host.name, host.ip) for host in self.hosts.hosts]
            else:
                self.nodes = [(socket.gethostname().split(".")[0], "127.0.0.1")]
            self.node = self.nodes[0][0]
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment, with the bed's ``SLURM_CONF`` and no variable of an enclosing job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**env, "SLURM_CONF": str(self.conf)}

    def job_env(self, **extra: str) -> dict[str, str]:
        """:attr:`env` for a test's job: this interpreter first on ``PATH``, the repository importable, one thread."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**self.env, "PATH": path, "PYTHONPATH": str(_ROOT), "OMP_NUM_THREADS": "1", **extra}
        env.pop("NPROC", None)  # the launchers page's train.py: under Slurm, Parallel spawns nothing
        return env

    def _daemon(self, argv: list[str], log: str, user: str | None = None, host: int | None = None) -> None:
        if self.hosts is not None and (host is not None or argv[0] == "slurmctld"):
            argv = self.hosts.hosts[host or 0].command(argv)
        with open(self.root / log, "ab") as out:
            self._daemons.append(
                subprocess.Popen(
                    argv,
                    env=self.env,
                    user=user,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # teardown kills the group: a daemon's children go with it
                )
            )

    def _start(self) -> None:
        munge = self.root / "munge"
        munge.mkdir()
        munge.chmod(0o755)  # the socket's directory: every user may reach it, only munge may write
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        owner = pwd.getpwnam("munge")
        for path in (munge, key):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        self.munge_socket = munge / "munge.socket"
        self.conf.write_text(
            _CONF.format(
                controller=f"{self.node}({self.nodes[0][1]})",
                slurmd_timeout=self.slurmd_timeout,
                kill_wait=KILL_WAIT_S,
                nodes="".join(f"NodeName={n} NodeAddr={ip} CPUs={_CPUS} State=UNKNOWN\n" for n, ip in self.nodes),
                node_dir="/tmp/slurmd" if self.hosts else self.root,  # a host's /tmp is its own
                ctld_port=free_port(),
                slurmd_port=free_port(),
                munge_socket=self.munge_socket,
                root=self.root,
                cpus=_CPUS,
                # ignite's Parallel under srun takes its port from the job id (15000 + its last 4 digits): beds
                # of concurrent runs number their jobs apart, so that they rarely meet on one port.
                first_job_id=secrets.randbelow(9000) + 1000,
            )
        )
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        self._daemon(
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={munge / 'munged.log'}",
            ],
            "munged.out",
            user="munge",
        )
        self._wait_for(lambda: self.munge_socket.exists(), "munged's socket")
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for k, (name, _) in enumerate(self.nodes):
            if self.hosts is not None:
                self.hosts.hosts[k].run(["mkdir", "-p", "/tmp/slurmd/spool"])
            self._daemon(["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd.{name}.out", host=k)
        self._wait_for(self._nodes_idle, f"nodes {[n for n, _ in self.nodes]} idle in sinfo")

    def _nodes_idle(self) -> bool:
        states = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).split()
        return states[1::2] == ["idle"] * len(self.nodes)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run against the bed: in its first host, where it has hosts (the controller is there)."""
        return self.hosts.hosts[0].command(argv) if self.hosts else argv

    def _wait_for(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not ready():  # type: ignore[operator]
            dead = [d.args[0] for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {_START_TIMEOUT_S:.0f} s"
                raise RuntimeError(f"Slurm test bed: waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.1)

    def run(self, argv: list[str], check: bool = True, timeout: float = 20.0) -> str:
        """Run a Slurm command (``scontrol``, ``sinfo``...) against the bed; its output."""
        done = subprocess.run(self.command(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def logs(self, lines: int = 15) -> str:
        """The last lines of every daemon's log."""
        out = []
        for log in sorted(self.root.rglob("*.log")) + sorted(self.root.glob("*.out")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    def requeued_at_once(self) -> contextlib.AbstractContextManager[None]:
        """While inside, a requeued job starts again 2 s after its requeue, not after ``cred_expire`` (2 minutes)."""
        return requeued_after(_REQUEUE_HOLD_S, lambda argv: self.run(argv, check=False))

    def cancel(self) -> None:
        """Cancel every job of the bed (a test's teardown: a job that outlived its deadline ends here)."""
        self.run(["scancel", "--full", "--quiet", "--user=root"], check=False, timeout=10.0)

    def close(self) -> None:
        """Cancel every job, kill the daemons and what they started, remove the directory."""
        if self._daemons and self._daemons[-1].poll() is None:
            with contextlib.suppress(Exception):
                self.cancel()
        for daemon in reversed(self._daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        self._daemons.clear()
        if self.hosts is not None:
            self.hosts.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lines:
    """A process's output, line by line as it comes: a thread reads it (``select`` on a buffered pipe misses lines
    read ahead into the buffer), :meth:`next` waits for the next one."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[str] = []
        self.came: list[float] = []  # when each line of ``seen`` came; then when the output ended
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.put((time.monotonic(), line))
        self._lines.put((time.monotonic(), ""))  # the end

    def next(self, deadline: float) -> str:
        """The next line, or "" if none comes before ``deadline`` (or the output ended)."""
        try:
            came, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return ""
        self.came.append(came)
        if line:
            self.seen.append(line)
        return line

    def rest(self, deadline: float) -> str:
        """Every line until the output ends (or ``deadline``), with those seen before."""
        while self.next(deadline):
            pass
        return "".join(self.seen)


def lines_until(lines: Lines, pattern: str, count: int, deadline: float) -> list[re.Match[str]]:
    """Read ``lines`` until ``count`` match ``pattern`` (an error showing what it read, if not)."""
    found: list[re.Match[str]] = []
    while len(found) < count:
        line = lines.next(deadline)
        if not line:
            raise AssertionError(f"{count} lines matching {pattern!r} did not come; output:\n{''.join(lines.seen)}")
        if match := re.match(pattern, line):
            found.append(match)
    return found


def main() -> int:
    reason = unavailable()
    if reason is None:
        try:
            with SlurmBed() as bed:
                out = bed.run(["srun", "-n", "2", "--time=1", "hostname"], timeout=60.0).split()
                version = bed.run(["sinfo", "--version"]).strip()
            if out != [bed.node, bed.node]:
                reason = f"srun -n 2 hostname printed {out}, not {bed.node} twice"
        except Exception as exc:
            reason = f"cannot start a Slurm node: {exc}"
    if reason:
        print(reason)
        return 1
    print(f"a Slurm node (munged, slurmctld, slurmd) starts here: {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
