"""A TCPStore served by a process of its own, as torchrun's agent serves it.

The world benchmark forks a thousand ranks: a server in the forking process would have its C++ thread logging and
resolving names while the process forks, and a child forked while that thread held a lock hangs on it. The
liveness tests need a store outside every rank's process, to stop it (``SIGSTOP``) or to outlive a killed rank 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import TracebackType

__all__ = ["StoreServer"]

_SERVE = textwrap.dedent(
    """
    import datetime, sys, time
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    print(store.port, flush=True)
    time.sleep(float(sys.argv[1]))
    """
)


class StoreServer:
    """A context manager: a TCPStore server process on 127.0.0.1, killed on exit (even if stopped).

    Args:
        lifetime_s: the server exits by itself after this long, should its owner die without killing it.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from benchmarks._store_server import StoreServer
        >>> with StoreServer() as server:
        ...     client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
        ...     client.set("k", "v")
        ...     client.get("k")
        b'v'
    """

    def __init__(self, lifetime_s: float = 900.0) -> None:
        self.lifetime_s = lifetime_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> StoreServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(self.lifetime_s)], stdout=subprocess.PIPE, start_new_session=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the store server exited with {self.proc.returncode} before listening")
        self.port = int(line)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
