"""Make the holders of a job-wide fetch join its chain in a known order: holder ``k`` waits ``k * delay`` first.

The chain's order is the order of arrival; a test that strikes "the holder in the middle" needs to know which one
that is. Patches this process's ``Relaying.join``; nothing else of the fetch changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["join_in_order"]


def join_in_order(position: int, delay: float, then: Callable[[], None] = lambda: None) -> None:
    """Delay this process's joins by ``position * delay`` seconds; call ``then`` once it has joined."""
    from ignite_ext.data.download import _relaying

    join = _relaying.Relaying.join

    def late_join(self: Any, *args: Any) -> Any:
        time.sleep(delay * position)
        member = join(self, *args)
        then()
        return member

    _relaying.Relaying.join = late_join  # type: ignore[method-assign]
