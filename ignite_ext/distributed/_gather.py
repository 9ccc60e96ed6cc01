"""Gathers built only on ``idist.all_gather`` of tensors (NCCL, Gloo, Horovod, XLA).

:func:`~ignite_ext.distributed.agree` exchanges through them by default, and the collective channel waits on them.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import ignite.distributed as idist
import torch

__all__ = ["all_gather_bytes", "all_gather_rows"]


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
