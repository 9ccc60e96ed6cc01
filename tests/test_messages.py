"""The messages users read say what happened and what to do in their words, and name the function they called.

Each test holds one message a user met with words of the package's insides (a keeper, a cut listener, a function
the user never called) or without saying which thing failed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch.distributed as dist

import ignite_ext.distributed as idist
from ignite_ext.data.cache import ShmSpaceError
from ignite_ext.data.cache.arena import Arena
from ignite_ext.distributed.liveness.detector import Cut
from ignite_ext.distributed.liveness.heartbeat import Heartbeat
from ignite_ext.errors import RankDiedError, RankFailedError, RankFailure

INTERNAL = ("keeper", "cut listener", "census", "verdict", "arena")


def test_a_rank_whose_process_ended_died_killed_or_crashed() -> None:
    cut = Cut(1, (2,), author=2, silent_s=0.0)
    error = RankFailedError([RankFailure(2, "RankDiedError", cut.message(), died=True)], "rank 0 waiting for rank 2")
    assert "rank 2 died: its process was killed or crashed" in str(error)
    assert not any(word in str(error) for word in INTERNAL), str(error)


def test_ranks_lost_together_died_together() -> None:
    message = Cut(1, (2, 3), author=1, silent_s=12.0).message()
    assert message.startswith("no heartbeat for 12 s (ranks [2, 3] died together), noticed by rank 1")
    assert "cut off from the network" in message


def test_a_rank_without_process_watch_says_what_that_means(caplog: pytest.LogCaptureFixture) -> None:
    # A HashStore is no TCPStore the package reaches on its own: deaths are noticed by silence alone.
    beat = Heartbeat(dist.HashStore(), rank=0, world_size=2, start=False)  # type: ignore[attr-defined]
    with caplog.at_level(logging.INFO, logger="ignite_ext.distributed"):
        assert beat._start_keeper_and_listener(last=True)
    lines = [r.getMessage() for r in caplog.records if "rank 0" in r.getMessage()]
    assert lines and "noticed by its silent heartbeat only" in lines[0], lines
    assert "IGNITE_EXT_HEARTBEAT_TIMEOUT" in lines[0]
    assert not any(word in lines[0] for word in INTERNAL), lines[0]


def test_one_rank_first_out_of_range_names_one_rank_first_and_what_to_do() -> None:
    with pytest.raises(ValueError) as info, idist.one_rank_first(rank=3):
        pass
    message = str(info.value)
    assert "one_rank_first" in message and "rank_scheduler" not in message, message
    assert "rank should be between 0 and 0, but given 3" in message  # ignite's words, which code may match
    assert "the job runs 1 process. Pass a rank from 0 to 0, or launch more processes" in message


def test_rank_scheduler_names_rank_scheduler() -> None:
    with (
        pytest.raises(ValueError, match="checking the arguments of rank_scheduler failed"),
        idist.rank_scheduler(idist.MasterFirst(rank=2)),
    ):
        pass


def test_a_live_rank_declared_dead_is_told_so_plainly() -> None:
    declared = RankFailure(1, "RankDiedError", "declared dead by its peers after its heartbeat stopped", died=True)
    message = str(RankDiedError([declared], "rank 1 (MasterFirst(rank=0, local=False))"))
    assert message.startswith("rank 1 (MasterFirst(rank=0, local=False)): this rank is alive, but the other ranks")
    assert "declared it dead" in message and "IGNITE_EXT_HEARTBEAT_TIMEOUT" in message
    assert "paused" in message and "Restart the job" in message
    assert "rank 1 died" not in message and "failed inside the scheduled block" not in message


def test_a_full_disk_dir_is_named_as_the_disk_not_as_shared_memory(tmp_path: Path) -> None:
    # What the persisted tier's fallback asks when another user's file has the name: no advice on /dev/shm there.
    with pytest.raises(ShmSpaceError) as info:
        Arena.create(1, 1 << 60, directory=str(tmp_path), knob="disk_bytes")
    message = str(info.value)
    assert message.startswith(f"the disk directory {tmp_path} (disk_dir) is too small: disk_bytes="), message
    assert "shm-size" not in message and "/dev/shm" not in message
    assert f"free space in {tmp_path}, or pass a roomier disk_dir" in message


def test_full_shared_memory_is_named_as_ram(tmp_path: Path) -> None:
    with pytest.raises(ShmSpaceError) as info:
        Arena.create(1, 1 << 60, directory=str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"RAM in {tmp_path} (shared memory) is too small: capacity_bytes="), message
    assert "--shm-size" in message
