"""A process forked while another thread of the rank held one of the package's locks does not hang in it.

A DataLoader worker is forked from the rank's main thread while the rank's own threads (the heartbeat, the watch
for a process group) may be inside the store's lookup, holding its lock. The child inherits the lock held, and
nobody in it will release it: the package's handlers that run in the child, and its code a worker calls later,
must not wait on it. Seen as a worker that never started (its rank waiting for it for ever) under torchrun.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests._world import free_port

#: The child exits at once when nothing blocks it; a hung one is killed after this (seconds).
CHILD_DEADLINE_S = 20.0

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch.distributed as dist
    from ignite_ext.distributed import _state
    from ignite_ext.distributed.liveness import heartbeat
    from ignite_ext.distributed.store import clients

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    heartbeat.watch_for_groups()
    lock = {{"clients": clients._GUARD, "state": _state._GUARD}}["{lock}"]
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:  # another thread of the rank, inside a lookup at the moment of the fork
            held.set()
            release.wait()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # what a forked DataLoader worker may ask of the package
        clients.group_store()
        _state.group_state(clients.group_store())
        os._exit(0)
    release.set()
    deadline = time.monotonic() + {deadline}
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exited", os.waitstatus_to_exitcode(status), flush=True)
            sys.exit(0)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("child hung", flush=True)
    sys.exit(1)
    """
)


@pytest.mark.distributed
@pytest.mark.timeout(3 * CHILD_DEADLINE_S + 60)
@pytest.mark.parametrize("lock", ["clients", "state"])
def test_a_child_forked_while_a_thread_held_a_lock_of_the_package_does_not_hang(lock: str) -> None:
    script = SCRIPT.format(port=free_port(), lock=lock, deadline=CHILD_DEADLINE_S)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=2 * CHILD_DEADLINE_S + 30
    )
    assert proc.returncode == 0 and "child exited 0" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
