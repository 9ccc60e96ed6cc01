"""Other users' files in the shared-memory directory neither break, shrink nor lose anyone's cache.

Each test creates a second Unix user (``useradd``; removed afterwards) and a private ``/dev/shm``: a tmpfs mounted
in a mount namespace of the test's own, held by a sleeping process, which every step enters with ``nsenter``. So
the other user's processes, their files and what they do to the directory stay out of the real ``/dev/shm``, the
free space is known exactly, and everything goes with the namespace. Steps run as real processes of their user
(``setpriv``), importing the package on their own; the test reads the namespace's files through
``/proc/<holder>/root``. A checkout (or its interpreter) in a directory others may not search, a clone in a
``mktemp -d`` folder or a private home, is opened up to them in that namespace only: see ``OPEN_UP``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ignite_ext._fs import pid_alive

ROOT = Path(__file__).resolve().parents[2]
USER_PREFIX = "ixcache"  # user names: ixcache<pid of the creating test process>x<random>
STEP_TIMEOUT_S = 90.0
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def _userdel(name: str) -> None:
    subprocess.run(["userdel", name], capture_output=True, timeout=30)
    subprocess.run(["groupdel", name], capture_output=True, timeout=30)  # when userdel kept the user group


def _remove_leftover_users() -> None:
    """Remove users an earlier, killed run of these tests created (its pid is in the name and no longer runs)."""
    for entry in pwd.getpwall():
        found = re.fullmatch(rf"{USER_PREFIX}(\d+)x[0-9a-f]+", entry.pw_name)
        if found and not pid_alive(int(found.group(1))):
            _userdel(entry.pw_name)


@pytest.fixture
def other_user() -> Iterator[User]:
    if os.geteuid() != 0:
        pytest.skip("creating a second Unix user (useradd) needs root")
    missing = [tool for tool in ("useradd", "userdel", "setpriv", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not installed: {missing}")
    _remove_leftover_users()
    name = f"{USER_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
    made = subprocess.run(
        ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        _userdel(name)
        assert name not in {e.pw_name for e in pwd.getpwall()}, f"user {name} could not be removed"


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


def _reap(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate(timeout=STEP_TIMEOUT_S)


def _unsearchable_dirs(paths: Iterable[Path]) -> list[Path]:
    """The directories on the way to ``paths`` (them included) that others may not search, outermost first."""
    found = set()
    for path in paths:
        for form in {path.absolute(), path.resolve()}:  # the kernel walks both a symlink's path and its target's
            for directory in (*reversed(form.parents), form):
                if not os.stat(directory).st_mode & stat.S_IXOTH:
                    found.add(directory.resolve())
    return sorted(found, key=lambda directory: len(directory.parts))


# Run as root in the namespace, once per directory of ``_unsearchable_dirs`` (outermost first): covers it with a
# tmpfs of the same owner and mode plus search by others (o+x; still no listing), with each of its entries put back
# in place (a bind mount of the original, a copy of a symlink). Nothing on disk changes, every path stays what it
# was, root's own steps see the same files, and it all goes with the namespace. The other user needs it because
# setpriv keeps root's capabilities until its exec, so that exec reaches a python under a private directory, but
# the interpreter it starts may not: a venv whose pyvenv.cfg it cannot read is no venv (no site-packages, no
# editable install), and the checkout the editable install maps ``ignite_ext`` to is out of reach. An entry that
# vanishes meanwhile is left out.
OPEN_UP = """
import os, stat, subprocess, sys
for directory in sys.argv[1:]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)  # the original, still reachable once covered
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode) | stat.S_IXOTH
    options = f"mode={mode:o},uid={st.st_uid},gid={st.st_gid}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory], check=True)
    for entry in os.scandir(fd):
        path = os.path.join(directory, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.name, dir_fd=fd), path)
            continue
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(path)
        else:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        source = f"/proc/self/fd/{fd}/{entry.name}"  # not canonicalized: that would name the covered path again
        bound = subprocess.run(
            ["mount", "--no-canonicalize", "--rbind", source, path], pass_fds=[fd], capture_output=True, text=True
        )
        if bound.returncode and entry.name in os.listdir(fd):
            sys.exit(f"cannot bind {path}: {bound.stderr}")
    os.close(fd)
"""


class PrivateShm:
    """A private tmpfs on ``/dev/shm`` in a mount namespace of its own, and processes run in it.

    In that namespace, the checkout, the venv and the interpreter are reachable by any user (``OPEN_UP``).
    """

    SIZE = 64 << 20

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            [
                *("unshare", "--mount", "--propagation", "private", "--", "sh", "-c"),
                f"mount -t tmpfs -o size={self.SIZE},mode=1777 tmpfs /dev/shm && echo ready && exec sleep 600",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs: list[subprocess.Popen[str]] = []
        if _first_line(self.holder, 30) != "ready":
            _, err = _reap(self.holder)
            pytest.skip(f"cannot mount a private /dev/shm in a mount namespace: {err.strip()}")
        self.dir = Path(f"/proc/{self.holder.pid}/root/dev/shm")  # the namespace's /dev/shm, seen from here
        closed = _unsearchable_dirs([ROOT, Path(sys.prefix), Path(sys.base_prefix)])
        if closed:
            opened = subprocess.run(
                [
                    *("nsenter", "-t", str(self.holder.pid), "-m", "--"),
                    *(sys.executable, "-c", OPEN_UP, *map(str, closed)),
                ],
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S,
            )
            if opened.returncode != 0:
                _reap(self.holder)
                pytest.fail(f"cannot open {closed} up to other users in the namespace:\n{opened.stderr[-3000:]}")

    def start(self, code: str, *args: str, user: User | None = None) -> subprocess.Popen[str]:
        as_user = [] if user is None else ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
        proc = subprocess.Popen(
            [
                *("nsenter", "-t", str(self.holder.pid), "-m", "--"),
                *as_user,
                *(sys.executable, "-c", textwrap.dedent(code), *args),
            ],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "HOME": "/tmp"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def run(self, code: str, *args: str, user: User | None = None) -> list[str]:
        """Run ``code`` to its end; return its output's words, or fail the test with its stderr."""
        proc = self.start(code, *args, user=user)
        try:
            out, err = proc.communicate(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out, err = _reap(proc)
            pytest.fail(f"a step ran past {STEP_TIMEOUT_S:.0f} s (blocked?)\n{err[-3000:]}")
        assert proc.returncode == 0, f"a step as {user.name if user else 'root'} failed:\n{err[-3000:]}"
        return out.split()

    def killed(self, code: str, *args: str, user: User | None = None) -> str:
        """Start ``code``, wait for its first line of output, SIGKILL it; return that line."""
        proc = self.start(code, *args, user=user)
        line = _first_line(proc, STEP_TIMEOUT_S)
        _, err = _reap(proc)
        assert line, f"the step printed nothing:\n{err[-3000:]}"
        return line

    def here(self, path: str) -> Path:
        """``path`` (as the namespace's processes name it) as this process reaches it."""
        return self.dir / os.path.relpath(path, "/dev/shm")

    def close(self) -> None:
        for proc in self.procs:
            _reap(proc)
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", "--", "umount", "/dev/shm"], timeout=30)
        _reap(self.holder)


@pytest.fixture
def private_shm(other_user: User) -> Iterator[PrivateShm]:
    """Depends on ``other_user`` so that its processes are gone before the user is deleted."""
    shm = PrivateShm()
    try:
        yield shm
    finally:
        shm.close()


# A cache that is then SIGKILLed with its files in place, as a killed job leaves them.
KILLED_JOB = """
import time
from ignite_ext.data import CachedDataset
ds = CachedDataset(list(range(10)), capacity_bytes=1 << 20)
ds[0]
print(ds.segment, flush=True)
time.sleep(300)
"""

NEW_CACHE = """
import sys
from ignite_ext.data import CachedDataset
from ignite_ext.data.cache import shm
free, promised = shm.available_bytes(), shm.promised_bytes()
ds = CachedDataset(list(range(10)), **({"capacity_bytes": int(sys.argv[1])} if sys.argv[1:] else {}))
assert [ds[i] for i in (3, 3, 4)] == [3, 3, 4] and ds.stats().hits == 1
print(ds.segment, ds.capacity_bytes, free, promised, flush=True)
"""


def _owner_and_mode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, stat.S_IMODE(st.st_mode)


@pytest.mark.slow  # four processes that each import torch
def test_a_killed_job_of_another_user_neither_breaks_a_cache_nor_is_swept_by_it(
    other_user: User, private_shm: PrivateShm
) -> None:
    root_stale = private_shm.here(private_shm.killed(KILLED_JOB))
    user_stale = private_shm.here(private_shm.killed(KILLED_JOB, user=other_user))
    assert _owner_and_mode(root_stale) == (0, 0o600)
    assert _owner_and_mode(user_stale) == (other_user.uid, 0o600)
    assert re.fullmatch(rf"ignite_ext_{other_user.uid}_\d+_cache_[0-9a-f]+\.arena", user_stale.name)

    # The other user's next cache: its own leftovers swept; root's 0600 arena (which it can neither open nor
    # delete) skipped instead of raising PermissionError.
    segment = private_shm.here(private_shm.run(NEW_CACHE, str(1 << 20), user=other_user)[0])
    assert not segment.exists()  # deleted at the normal exit
    assert not user_stale.exists() and not user_stale.with_suffix(".lock").exists()
    assert root_stale.exists() and root_stale.with_suffix(".lock").exists()

    # Root, which could delete anything, sweeps its own leftovers only.
    user_stale = private_shm.here(private_shm.killed(KILLED_JOB, user=other_user))
    private_shm.run(NEW_CACHE, str(1 << 20))
    assert not root_stale.exists() and not root_stale.with_suffix(".lock").exists()
    assert user_stale.exists() and user_stale.with_suffix(".lock").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# Files another user plants to look like the victim's arenas: sparse, with a huge apparent size.
FORGER = """
import os, sys, time
directory, names = sys.argv[1], sys.argv[2:]
for name in names:
    fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 50)  # 1 PiB apparent size, not one page of it allocated
    os.close(fd)
print("ready", flush=True)
"""


def test_forged_sparse_files_of_another_user_do_not_shrink_the_default_capacity(
    other_user: User, private_shm: PrivateShm
) -> None:
    forged = [
        f"ignite_ext_1_cache_{'ab' * 8}.arena",  # the former name of an arena of a live process (pid 1)
        f"ignite_ext_0_1_cache_{'cd' * 8}.arena",  # today's name of one of root's, of a live process
        f"ignite_ext_0_{_dead_pid()}_cache_{'ef' * 8}.arena",  # and of a dead one: a sweep's candidate
    ]
    assert private_shm.run(FORGER, "/dev/shm", *forged, user=other_user) == ["ready"]
    _, capacity, free, promised = private_shm.run(NEW_CACHE)  # root's default-capacity cache
    assert int(promised) == 0  # nothing of root's: the forged files are not counted
    assert 0.49 * int(free) <= int(capacity) <= 0.5 * int(free)
    for name in forged:  # and not swept either: they are not root's
        assert _owner_and_mode(private_shm.dir / name) == (other_user.uid, 0o600)


# Another user holds an exclusive flock on the directory and on the victim's creation lock file, taken first.
LOCKER = """
import fcntl, os, sys, time
directory, victim = sys.argv[1], sys.argv[2]
held = []
squatted = os.path.join(directory, f"ignite_ext_{victim}.lock")
for path, flags in ((directory, os.O_RDONLY), (squatted, os.O_CREAT | os.O_RDWR)):
    fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.append(fd)
print("ready", flush=True)
time.sleep(300)
"""


def test_locks_another_user_holds_do_not_block_cache_creation(other_user: User, private_shm: PrivateShm) -> None:
    locker = private_shm.start(LOCKER, "/dev/shm", "0", user=other_user)
    assert _first_line(locker, STEP_TIMEOUT_S) == "ready"
    started = time.monotonic()
    segment, capacity, _, _ = private_shm.run(NEW_CACHE)
    assert time.monotonic() - started < 60 and int(capacity) > 1 << 20
    assert not private_shm.here(segment).exists()
    assert _owner_and_mode(private_shm.dir / "ignite_ext_0.lock") == (other_user.uid, 0o600)  # left alone
    assert locker.poll() is None
