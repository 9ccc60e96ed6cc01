"""Horovod has no c10d store: the scheduler's side-channel TCPStore (rank 0 hosts it), and its fallback.

That the store channel runs on Horovod is what ``tests/backends/test_waiting.py`` shows by behaviour (``timeout=``
honoured, a hung rank declared dead); here the log line that says so, and the collective fallback when rank 0
cannot serve.
"""

from __future__ import annotations

import socket

import pytest

from tests._world import BACKENDS, World
from tests.backends import _bodies

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.parametrize("world", [p for p in BACKENDS if p.id == "horovod-4"], indirect=True),
]


def test_store_channel_on_horovod_says_so(world: World) -> None:
    # A world of its own (any env does that): the line comes with the world's first block.
    seen = world(_bodies.channel_in_use, 3.0, 1.0, env={"IGNITE_EXT_WAIT_LOG_INTERVAL": "30"})
    assert [s["outcome"] for s in seen] == ["RankFailedError"] + ["TimeoutError"] * (world.nprocs - 1)
    assert any("on horovod, ranks wait through a TCPStore at " in line for line in seen[0]["log"]), seen[0]["log"]


def test_collective_fallback_when_rank_0_cannot_serve(world: World) -> None:
    # The port rank 0 is told to use is taken: no server, so every rank falls back to the collective channel,
    # where waits are collectives (timeout= not enforced) and rank 0 logs why.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        seen = world(_bodies.channel_in_use, 3.0, 1.0, env={"IGNITE_EXT_STORE_PORT": str(port)})
    assert [s["outcome"] for s in seen] == ["ok"] * world.nprocs
    assert all(s["waited"] >= 2.5 for s in seen[1:]), [s["waited"] for s in seen]
    warning = [line for line in seen[0]["log"] if "on horovod, ranks wait in the backend's collectives" in line]
    assert warning and "no TCPStore server could start on rank 0" in warning[0], seen[0]["log"]
