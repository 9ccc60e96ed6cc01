"""Backend-agnostic collectives built only on ``idist.all_gather`` of tensors (NCCL, Gloo, Horovod, XLA).

Also the scheduler's collective channel, built on them (see :mod:`ignite_ext.distributed._channel`).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import ignite.distributed as idist
import torch

from ignite_ext.distributed._channel import Channel, decode_failures, encode_failures
from ignite_ext.distributed.policies import Comm, Plan
from ignite_ext.errors import RankFailure

__all__ = ["CollectiveChannel", "IdistComm", "all_gather_bytes", "all_gather_rows"]


def all_gather_rows(row: list[int]) -> list[list[int]]:
    """Gather one small row of integers from every rank, in one collective.

    Keep the values below 2**24: some backends (XLA) run collectives in float32.
    """
    if idist.get_world_size() == 1:
        return [list(row)]
    t = torch.tensor([row], dtype=torch.int64, device=idist.device())
    gathered = idist.all_gather(t)
    assert isinstance(gathered, torch.Tensor)
    return [[int(v) for v in r] for r in gathered.cpu().tolist()]


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Gather a byte string of any length from every rank (two collectives: lengths, then padded bytes)."""
    if idist.get_world_size() == 1:
        return [data]
    lengths = [r[0] for r in all_gather_rows([len(data)])]
    width = max(1, max(lengths))
    buf = torch.zeros((1, width), dtype=torch.uint8)
    if data:
        buf[0, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = idist.all_gather(buf.to(idist.device()))
    assert isinstance(gathered, torch.Tensor)
    rows = gathered.to("cpu", torch.uint8)
    return [bytes(rows[r, : lengths[r]].tolist()) for r in range(len(lengths))]


class IdistComm(Comm):
    """:class:`~ignite_ext.distributed.Comm` over the current idist computation model."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, pickled through :func:`all_gather_bytes`."""
        return [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(obj))]


_OK, _FAILED, _SKIPPED = 0, 1, 2


class CollectiveChannel(Channel):
    """Steps all ranks through the plan's waves in lockstep, one ``all_gather`` per wave."""

    def __init__(self, rank: int, world_size: int, label: str, timeout: float | None) -> None:
        super().__init__(rank, world_size, label, timeout)
        self.levels: tuple[int, ...] = ()
        self.level = 0
        self.wave = 0
        self.failed: dict[int, list[RankFailure]] = {}  # rank -> the original failures it carries
        self.original: list[RankFailure] = []

    def exchange(self, mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
        """Gather every entry with collectives; every rank judges the same entries itself."""
        return judge(all_gather_bytes(mine))

    def start(self, plan: Plan) -> None:
        """Adopt the plan and compute the waves to step through."""
        super().start(plan)
        self.levels = plan.levels()
        self.level = self.levels[self.rank]

    def _boundary(self, state: int, own: list[RankFailure]) -> None:
        states = [row[0] for row in all_gather_rows([state if self.level == self.wave else _OK])]
        if any(s == _FAILED for s in states):
            blobs = all_gather_bytes(encode_failures(own) if states[self.rank] == _FAILED else b"[]")
            for r, s in enumerate(states):
                if s == _FAILED:
                    self.original += decode_failures(blobs[r])
        for r, s in enumerate(states):
            if s != _OK:
                self.failed[r] = [f for f in self.original if s == _FAILED and f.rank == r] or self._inherited(r)
        self.wave += 1

    def _inherited(self, rank: int) -> list[RankFailure]:
        out = [f for a in self.plan.turns[rank].after for f in self.failed.get(a, [])]
        return sorted(set(out), key=lambda f: f.rank)

    def wait_turn(self) -> list[RankFailure]:
        while self.wave < self.level:
            self._boundary(_OK, [])
        return self._inherited(self.rank)

    def leave(self, own: list[RankFailure], inherited: list[RankFailure], linger: bool = True) -> list[RankFailure]:
        state = _FAILED if own else _SKIPPED if inherited else _OK
        last = max(self.levels)
        while self.wave <= last:
            self._boundary(state, own)
        return sorted(set(self.original), key=lambda f: f.rank)
