"""What this process knows of the scheduled blocks of one process group.

That is the next sequence number, which blocks this process has left (so that their store keys can be deleted once
every rank has left them), and per thread how deep it is inside blocks and which world the outermost one agreed on.

The sequence number names a block in the store (:class:`~ignite_ext.distributed.store.keys.BlockKeys`): every rank
enters the blocks of a group in the same order, so the same number names the same block on every rank. It belongs
to the group (a new process group starts a new store, and numbers from 0), and is taken under a lock, so two
threads entering blocks at once never share one. Nesting is per thread: a scheduler entered by another thread
while the main thread is inside a block is a block of its own, not a nested one.

Blocks of different threads overlap, so entering block ``seq`` does not prove that block ``seq - 1`` is over.
Instead every rank reports its *low-water mark* (every block below it has been left by this process) when it enters
a block; the verdict carries the lowest mark of all ranks, and the keys of every block below that mark are deleted.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ignite_ext.distributed.policies import World

__all__ = ["GroupState", "group_state"]


class _Nesting(threading.local):
    depth = 0
    world: World | None = None


class GroupState:
    """One process group's scheduler state in this process.

    Examples:
        >>> from ignite_ext.distributed._state import GroupState
        >>> from ignite_ext.distributed.policies import World
        >>> state = GroupState()
        >>> state.take_sequence(), state.take_sequence()
        (0, 1)
        >>> with state.inside(World(1, (0,), (0,))):
        ...     state.depth, state.world.world_size
        (1, 1)
        >>> state.depth, state.world
        (0, None)
        >>> state.leave(1); state.low_water  # block 0 is not over yet
        0
        >>> state.leave(0); state.low_water, list(state.forget_below(state.low_water))
        (2, [0, 1])

    .. versionadded:: 0.2.0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._nesting = _Nesting()
        self._left: set[int] = set()
        self._low_water = 0
        self._forgotten = 0
        #: Keys of a block that only this process knows of (its failure details), by block.
        self.carried: dict[int, list[str]] = {}

    def take_sequence(self) -> int:
        """The number of the next communicating block of this group (each number is taken once)."""
        with self._lock:
            seq, self._next = self._next, self._next + 1
        return seq

    def leave(self, seq: int) -> None:
        """Record that this process is done with block ``seq`` (it reads none of its keys any more)."""
        with self._lock:
            self._left.add(seq)
            while self._low_water in self._left:
                self._left.remove(self._low_water)
                self._low_water += 1

    @property
    def low_water(self) -> int:
        """Every block numbered below this has been left by this process."""
        return self._low_water

    def forget_below(self, mark: int) -> range:
        """The blocks below ``mark`` (every rank's low-water mark) whose keys nobody deleted yet; each is given once."""
        with self._lock:
            start = self._forgotten
            self._forgotten = max(start, mark)
        return range(start, max(start, mark))

    @property
    def depth(self) -> int:
        """How many scheduled blocks of this group the calling thread is inside."""
        return self._nesting.depth

    @property
    def world(self) -> World | None:
        """The world the calling thread's outermost block agreed on, or None outside blocks."""
        return self._nesting.world

    @contextmanager
    def inside(self, world: World) -> Iterator[None]:
        """Count the calling thread as inside a block of ``world`` for the duration."""
        nesting = self._nesting
        outer = nesting.world
        nesting.depth += 1
        nesting.world = world if outer is None else outer
        try:
            yield
        finally:
            nesting.depth -= 1
            nesting.world = outer


_BY_STORE: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
# Groups without a store of their own (Horovod, XLA, serial): their one world per process.
_WITHOUT_STORE = GroupState()
_GUARD = threading.Lock()


def _new_guard_in_child() -> None:
    global _GUARD
    _GUARD = threading.Lock()  # another thread may have held it at the fork: nobody would release it here


os.register_at_fork(after_in_child=_new_guard_in_child)


def group_state(store: object | None) -> GroupState:
    """The state of the process group whose store is ``store`` (None: the group without a store).

    Examples:
        >>> from ignite_ext.distributed._state import group_state
        >>> group_state(None) is group_state(None)
        True

    .. versionadded:: 0.2.0
    """
    if store is None:
        return _WITHOUT_STORE
    with _GUARD:
        state = _BY_STORE.get(store)
        if state is None:
            state = _BY_STORE[store] = GroupState()
        return state
