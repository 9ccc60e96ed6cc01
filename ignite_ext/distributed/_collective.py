"""The policies' :class:`~ignite_ext.distributed.Comm` and the scheduler's collective channel.

Both run on the gathers of :mod:`ignite_ext.distributed._gather` (see :mod:`ignite_ext.distributed._channel`).

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from ignite_ext.distributed._channel import Channel, decode_failures, encode_failures
from ignite_ext.distributed._gather import all_gather_bytes, all_gather_rows
from ignite_ext.distributed.policies import Comm, Plan
from ignite_ext.errors import CollectiveError, RankFailure

__all__ = ["CollectiveChannel", "IdistComm"]


class IdistComm(Comm):
    """:class:`~ignite_ext.distributed.Comm` over the current idist computation model."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, pickled through :func:`all_gather_bytes`."""
        try:
            blobs = all_gather_bytes(pickle.dumps(obj))
        except RuntimeError as exc:  # gloo's "Connection closed by peer", NCCL's errors, a timeout
            # A peer died or was cut off, or the collective timed out: the scheduler asks its channel what explains
            # it (Channel.explain), the dead ranks' cut when there is one.
            raise CollectiveError(f"a gather of the plan failed in the backend: {exc}") from exc
        return [pickle.loads(b) for b in blobs]


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
