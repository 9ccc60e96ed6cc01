"""Another Unix user's process in a shared data folder: a download lock it takes and never lets go of ends the
download with an error that names it, within a bound made of the call's own options, and nothing of theirs is
touched.

The other user is a real second Unix user (``other_user``, from the cache's second-user tests). Its lock holder is a
real process of that user, started with ``setpriv`` in ``PrivateShm``'s mount namespace, where the interpreter is
within its reach even when it lives under a private directory; it needs the standard library only. The folder is a
group's shared folder (setgid, group-writable, no sticky bit) in ``/tmp``, which that namespace shares with this one.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.data import DownloadError, download_url
from tests.data.test_cache_users import STEP_TIMEOUT_S, PrivateShm, User, _first_line, _reap
from tests.data.test_cache_users import other_user as other_user  # fixtures of the second-user tests, used here too
from tests.data.test_cache_users import private_shm as private_shm

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

DATA = random.Random(21).randbytes(100_000)
SHA = hashlib.sha256(DATA).hexdigest()

# Another user's program that takes the record lock of a group-writable lock file (what a umask of 002 leaves) and
# never lets go; the file holds bytes of its own. Standard library only: it does not import the package.
STRANGER = """
import fcntl, os, sys, time
os.umask(0o002)
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o666)
os.write(fd, b"the other user's own bytes\\n")
fcntl.lockf(fd, fcntl.LOCK_EX)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def _state(path: Path) -> tuple[Any, ...]:
    """Everything about a file that a write, a chmod, a chown or a replacement would change."""
    st = os.lstat(path)
    return st.st_ino, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, path.read_bytes()


@pytest.fixture
def shared_folder(other_user: User) -> Any:
    """A group's data folder: setgid and group-writable for the other user's group (root may write anyway)."""
    folder = Path(tempfile.mkdtemp(prefix="ignite_ext-shared-"))
    os.chown(folder, -1, other_user.gid)
    folder.chmod(0o2770)  # no sticky bit: in a sticky folder fs.protected_regular may refuse to open their file
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    ("options", "patience"),
    [
        ({"deadline": 3.0}, 3.0),  # the call's own deadline, shorter than 2 * (30 + 30) s
        ({"timeout": 1.0, "low_speed_time": 1.0}, 4.0),  # no deadline: 2 * (timeout + low_speed_time)
    ],
    ids=["deadline", "timeout"],
)
def test_a_lock_another_user_never_lets_go_of_ends_the_download_with_an_error_naming_its_holder(
    other_user: User,
    private_shm: PrivateShm,
    shared_folder: Path,
    server: TestHTTPServer,
    options: dict[str, float],
    patience: float,
) -> None:
    url = server.add("/a.bin", DATA)
    lock = shared_folder / ".a.bin.lock"
    stranger = private_shm.start(STRANGER, str(lock), user=other_user)
    outcome: list[object] = []
    waiter = None
    try:
        line = _first_line(stranger, STEP_TIMEOUT_S)
        assert line.isdigit(), f"the other user's lock holder did not start:\n{_reap(stranger)[1][-3000:]}"
        pid = int(line)
        before = _state(lock)
        assert before[1:4] == (other_user.uid, other_user.gid, 0o664)

        def call() -> None:
            try:
                outcome.append(download_url(url, shared_folder, sha256=SHA, progress=False, **options))
            except BaseException as exc:
                outcome.append(exc)

        # The waiter names the holder on entry, looks again `patience` seconds later and gives up then; three times
        # the bound plus 10 s leaves room for a 2-core host busy with other jobs (interpreter start-up, /proc reads),
        # while a wait that never ends (one unbounded F_SETLKW) still fails here rather than at pytest's timeout.
        limit = 3 * patience + 10.0
        started = time.monotonic()
        waiter = threading.Thread(target=call, daemon=True)
        waiter.start()
        waiter.join(limit)
        waited = time.monotonic() - started
        assert not waiter.is_alive(), f"download_url still waits for {other_user.name}'s lock after {waited:.0f} s"

        (error,) = outcome
        assert isinstance(error, DownloadError), error
        message = str(error)
        assert f"pid {pid} on this host (user {other_user.name}, python" in message, message
        assert str(lock) in message and "a process of another user" in message, message
        assert message.startswith(f"{url}: gave up after ") and f"for {patience:g} s" in message, message
        assert waited >= patience  # a stranger's lock is waited for the whole bound, not given up on sight
        # Nothing fetched, nothing written beside their file, and their file untouched; their process left running.
        assert server.requests("/a.bin") == []
        assert sorted(os.listdir(shared_folder)) == [lock.name]
        assert _state(lock) == before
        assert stranger.poll() is None
    finally:
        _reap(stranger)
        if waiter is not None:
            waiter.join(30)  # once the lock is free, a waiter that never gave up goes on: let it end first
