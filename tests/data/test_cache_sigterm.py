"""A rank SIGTERMed by its launcher (another rank failed) deletes its cache files, unless its elastic agent lives.

Real processes and a real ``SIGTERM``, sent by the test as ``idist.Parallel`` or torchrun send it to the ranks that
are left when one fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.data.test_cache import ROOT
from tests.data.test_cache_disk import _arenas
from tests.data.test_cache_restart import SOURCE
from tests.data.test_cache_users import STEP_TIMEOUT_S, _first_line

pytestmark = pytest.mark.distributed

# A rank with a cache of 8 samples (RAM and disk tiers), 4 of them read. With "wait" or "chain" (a SIGTERM handler
# of the program's own, set first), it prints its files and the SIGTERM handlers of its main process and of a
# DataLoader worker, then waits for the signal; with "read", it prints what it loaded and its stats, and exits.
RANK = (
    """
import os, signal, sys, time
from torch.utils.data import DataLoader
from ignite_ext.data import CachedDataset
"""
    + SOURCE
    + """
def handler():
    found = signal.getsignal(signal.SIGTERM)
    return getattr(found, "__name__", None) or getattr(found, "name", "?")

class Handler:
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return handler()

if sys.argv[2] == "chain":
    def previous(signum, frame):
        print("previous handler", signum, flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, previous)

ds = CachedDataset(Source(), capacity_bytes=12000, disk_dir=sys.argv[1], disk_bytes=1 << 20)
got = [ds[i] for i in range(4)]
st = ds.stats()
if sys.argv[2] == "read":
    print("loaded", loaded, st.hits, st.misses, st.entries, flush=True)
    sys.exit(0)
dl = DataLoader(Handler(), num_workers=1, multiprocessing_context="fork", collate_fn=lambda batch: batch[0])
worker = next(iter(dl))
print("ready", ds.segment, ds.disk_segment, handler(), worker, flush=True)
if sys.argv[2] == "fail":  # an exception nobody catches, as a peer's death met in a collective raises
    raise RuntimeError("Connection closed by peer")
time.sleep(10 * 60)
"""
)


def _rank(disk_dir: Path, mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RANK), str(disk_dir), mode],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _terminated(disk_dir: Path, mode: str, env: dict[str, str]) -> tuple[int, list[str], str]:
    """Run a rank until it is ready, SIGTERM it (unless it fails by itself, ``mode`` "fail"): its exit status, its
    ready line's words, and its output after."""
    proc = _rank(disk_dir, mode, env)
    try:
        line = _first_line(proc, STEP_TIMEOUT_S)
        assert line.startswith("ready "), proc.stderr.read() if proc.poll() is not None and proc.stderr else line
        if mode != "fail":
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=STEP_TIMEOUT_S)
    return proc.returncode, line.split()[1:], out + err


def _files(segments: list[str]) -> list[str]:
    return [f for s in segments for f in (s, s[: -len(".arena")] + ".lock") if os.path.exists(f)]


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}


def test_a_sigtermed_rank_deletes_its_files_and_still_dies_of_sigterm(tmp_path: Path) -> None:
    code, (ram, disk, mine, worker), _ = _terminated(tmp_path, "wait", _plain_env())
    assert ram.startswith("/dev/shm/") and os.path.dirname(disk) == str(tmp_path.resolve())
    assert code == -signal.SIGTERM  # the default action, delivered again after the cleanup
    assert _files([ram, disk]) == [] and _arenas(tmp_path) == []
    assert mine == "_on_sigterm" and worker == "SIG_DFL"  # a DataLoader worker has the handler before the cache's


def test_the_programs_own_sigterm_handler_runs_and_the_files_go_at_its_exit(tmp_path: Path) -> None:
    code, (ram, disk, mine, worker), out = _terminated(tmp_path, "chain", _plain_env())
    assert code == 7 and f"previous handler {int(signal.SIGTERM)}" in out, out
    assert _files([ram, disk]) == [] and _arenas(tmp_path) == []
    assert mine == "_on_sigterm" and worker == "previous"


def _job(restart: str, max_restarts: str) -> dict[str, str]:
    """A worker's environment as torchrun's agent sets it (the test is the agent, and lives on)."""
    return {**_plain_env(), "TORCHELASTIC_RUN_ID": f"term-{uuid.uuid4().hex}",
            "TORCHELASTIC_RESTART_COUNT": restart, "TORCHELASTIC_MAX_RESTARTS": max_restarts}  # fmt: skip


@pytest.mark.parametrize("mode", ["wait", "fail"], ids=["sigtermed", "failed"])
def test_an_attempt_with_a_restart_left_leaves_its_files_to_the_restart(tmp_path: Path, mode: str) -> None:
    # Failed: a survivor meets its peer's death in a collective and exits with the error before the agent's
    # SIGTERM; the restart read every sample again when the files went at that exit (2 of 3 real torchrun runs).
    job = _job("0", "1")
    code, (ram, disk, _, _), out = _terminated(tmp_path, mode, job)
    assert code == (-signal.SIGTERM if mode == "wait" else 1), out
    assert len(_files([ram, disk])) == 4  # both tiers and their locks, for the restarted group
    restarted = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RANK), str(tmp_path), "read"],
        cwd=ROOT,
        env={**job, "TORCHELASTIC_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    # The restart's first reads come from the cache the attempt left: nothing loaded from storage.
    assert restarted.returncode == 0 and restarted.stdout.strip() == "loaded [] 4 0 4", restarted.stderr
    assert _files([ram, disk]) == [] and _arenas(tmp_path) == []  # renamed by the adopter, deleted at its end


@pytest.mark.parametrize("mode", ["wait", "fail"], ids=["sigtermed", "failed"])
def test_the_last_attempt_leaves_nothing_however_it_ends(tmp_path: Path, mode: str) -> None:
    # No restart can come (the agent's count reached its maximum): the files went only with the agent before.
    code, (ram, disk, _, _), out = _terminated(tmp_path, mode, _job("1", "1"))
    assert code == (-signal.SIGTERM if mode == "wait" else 1), out
    assert _files([ram, disk]) == [] and _arenas(tmp_path) == []


# Where the handler is installed: not by a cache created in another thread, nor over an ignored SIGTERM; in the
# main thread over the default action, once.
WHERE = """
import signal, sys, tempfile, threading
from ignite_ext.data.cache.arena import Arena

def name():
    found = signal.getsignal(signal.SIGTERM)
    return getattr(found, "__name__", None) or getattr(found, "name", "?")

directory = tempfile.mkdtemp(dir=sys.argv[1])
made = []
thread = threading.Thread(target=lambda: made.append(Arena.create(4, 1 << 20, directory=directory)))
thread.start()
thread.join()
print("thread", name())
signal.signal(signal.SIGTERM, signal.SIG_IGN)
made.append(Arena.create(4, 1 << 20, directory=directory))
print("ignored", name())
signal.signal(signal.SIGTERM, signal.SIG_DFL)
made += [Arena.create(4, 1 << 20, directory=directory) for _ in range(2)]
print("main", name())
"""


def test_the_handler_is_installed_only_by_the_main_thread_over_the_default_action(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WHERE), str(tmp_path)],
        cwd=ROOT,
        env=_plain_env(),
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["thread SIG_DFL", "ignored SIG_IGN", "main _on_sigterm"], proc.stdout
