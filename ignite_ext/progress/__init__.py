"""Progress: how far a scheduled block's first ranks got, for the ranks that wait for them.

``from ignite_ext import progress``, then inside a block ``progress.report(done, total, what=...)``,
``progress.advance()`` or ``for x in progress.track(items): ...``. Waiting ranks log it, errors carry it, and a
``stall_timeout`` on the block reports a first rank whose reported work stopped advancing (see the scheduling
guide, "Slow, stalled or dead"). Standard library only.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

from ignite_ext.progress.board import Progress, begin
from ignite_ext.progress.board import read as current
from ignite_ext.progress.report import advance, finish, report, track

__all__ = ["Progress", "advance", "begin", "current", "finish", "report", "track"]
