"""Scheduling policies: who runs a block first, and who waits for whom.

A policy turns the shape of the world (ranks, nodes) into a :class:`Plan`: for every rank, the ranks whose
block must finish before it runs its own, and the :class:`Turn` it yields. The scheduler
(:func:`~ignite_ext.distributed.rank_scheduler`) does all communication, failure propagation and waiting;
a policy is pure bookkeeping, so a new one is a small class and needs no change to the scheduler.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ignite_ext.distributed.agreement import agree

__all__ = ["Comm", "MasterFirst", "Ordered", "Plan", "Policy", "Turn", "World"]

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """The shape of the world a plan is made for, identical on every rank.

    Args:
        world_size: number of ranks.
        node_ranks: node index of every rank.
        local_ranks: index of every rank within its node.

    Examples:
        >>> from ignite_ext.distributed import World
        >>> w = World(4, node_ranks=(0, 0, 1, 1), local_ranks=(0, 1, 0, 1))
        >>> w.nodes()
        {0: (0, 1), 1: (2, 3)}

    .. versionadded:: 0.1.0
    """

    world_size: int
    node_ranks: tuple[int, ...]
    local_ranks: tuple[int, ...]

    def nodes(self) -> dict[int, tuple[int, ...]]:
        """Return the ranks of each node, keyed by node index, each in rank order."""
        out: dict[int, list[int]] = {}
        for rank, node in enumerate(self.node_ranks):
            out.setdefault(node, []).append(rank)
        return {node: tuple(ranks) for node, ranks in sorted(out.items())}

    def nproc_per_node(self) -> int:
        """Return the largest number of ranks on one node."""
        return max(len(r) for r in self.nodes().values())


@dataclass(frozen=True)
class Turn:
    """What ``with rank_scheduler(...) as turn:`` yields on one rank; truthy when this rank runs first.

    Args:
        rank: this rank.
        first: whether this rank runs in the first wave (e.g. should download).
        after: ranks whose block must finish before this rank runs its own.
        group: the ranks this rank is scheduled with (its node, its shared directory, or the world).
        leader: the rank of ``group`` that runs first.

    Examples:
        >>> from ignite_ext.distributed import Turn
        >>> turn = Turn(rank=1, first=False, after=frozenset({0}), group=(0, 1), leader=0)
        >>> bool(turn), turn.leader
        (False, 0)

    .. versionadded:: 0.1.0
    """

    rank: int
    first: bool
    after: frozenset[int]
    group: tuple[int, ...]
    leader: int

    def __bool__(self) -> bool:
        return self.first


@dataclass(frozen=True)
class Plan:
    """One :class:`Turn` per rank, indexed by rank.

    Args:
        turns: the turns, ``turns[r].rank == r``.

    Raises:
        ValueError: when turns are out of order, name unknown ranks, or wait for each other in a cycle.

    Examples:
        >>> from ignite_ext.distributed import Plan, Turn
        >>> plan = Plan((Turn(0, True, frozenset(), (0, 1), 0), Turn(1, False, frozenset({0}), (0, 1), 0)))
        >>> plan.levels()
        (0, 1)

    .. versionadded:: 0.1.0
    """

    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        n = len(self.turns)
        for r, turn in enumerate(self.turns):
            if turn.rank != r:
                raise ValueError(f"plan: turn {r} is for rank {turn.rank}")
            if any(not 0 <= a < n or a == r for a in turn.after):
                raise ValueError(f"plan: rank {r} waits for {sorted(turn.after)}, not ranks of 0..{n - 1} but itself")
        self.levels()  # raises on a cycle

    def levels(self) -> tuple[int, ...]:
        """Return each rank's wave: 0 for ranks that wait for nobody, else one more than their latest predecessor.

        Raises:
            ValueError: when ranks wait for each other in a cycle.
        """
        level: dict[int, int] = {}
        visiting: set[int] = set()

        def depth(r: int) -> int:
            if r in level:
                return level[r]
            if r in visiting:
                raise ValueError(f"plan: ranks wait for each other in a cycle through rank {r}")
            visiting.add(r)
            level[r] = max((depth(a) + 1 for a in self.turns[r].after), default=0)
            visiting.discard(r)
            return level[r]

        return tuple(depth(r) for r in range(len(self.turns)))


class Comm(ABC):
    """Collective helpers a policy may use while planning (e.g. a filesystem census).

    Every rank must make the same calls in the same order, as with any collective.

    .. versionadded:: 0.1.0
    """

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj`` (picklable), indexed by rank."""

    def agree(self, fn: Callable[[], T], what: str) -> list[T]:
        """Run ``fn`` on every rank and gather the results; if it raised anywhere, raise everywhere.

        This is :func:`ignite_ext.distributed.agree` over this object's :meth:`all_gather_object`.

        Args:
            fn: the local step; its result must be picklable.
            what: a few words for the error message, e.g. ``"creating the census marker"``.

        Returns:
            Every rank's result, indexed by rank.

        Raises:
            ValueError: on every rank when ``fn`` raised ``ValueError`` or ``OSError`` on any rank.
            RuntimeError: on every rank when ``fn`` raised anything else on any rank.
        """
        return agree(fn, what, exchange=lambda mine, judge: judge(list(self.all_gather_object(mine))))


class Policy(ABC):
    """Decides which ranks run a block first and who waits for whom.

    Subclass it to write your own order; implement :meth:`plan` (pure: the same on every rank) and, if the
    policy has arguments, :meth:`validate` and :meth:`describe`. The scheduler checks that every rank passed
    an equal policy (same type and :meth:`describe`) before anyone runs anything.

    Examples:
        A policy in which the highest rank goes first and the others follow one at a time, downwards:

        >>> from ignite_ext.distributed import Plan, Policy, Turn, World
        >>> class Reversed(Policy):
        ...     def plan(self, world, comm):
        ...         n = world.world_size
        ...         return Plan(tuple(
        ...             Turn(r, r == n - 1, frozenset({r + 1}) if r < n - 1 else frozenset(), tuple(range(n)), n - 1)
        ...             for r in range(n)))
        >>> plan = Reversed().plan(World(3, (0, 0, 0), (0, 1, 2)), comm=None)
        >>> [sorted(t.after) for t in plan.turns]
        [[1], [2], []]

    .. versionadded:: 0.1.0
    """

    #: Whether :meth:`plan` communicates (then the policy cannot be nested inside another scheduled block).
    collective: bool = False

    def validate(self, world: World) -> None:
        """Raise ``ValueError`` when the arguments do not fit ``world``. Called on every rank."""
        return None

    def describe(self) -> str:
        """Return a canonical text of the arguments; ranks must agree on it."""
        return repr(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abstractmethod
    def plan(self, world: World, comm: Comm) -> Plan:
        """Return the plan for ``world``; must be identical on every rank."""


def _check_int(name: str, value: object) -> int:
    # What ignite's one_rank_first accepts: anything usable as an index (numpy and torch integers included).
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} should be an int, but given {value!r} ({type(value).__name__})") from None


def _check_bool(name: str, value: object) -> bool:
    # Truthy or falsy, as ignite's ``if local`` takes it; only values without a truth value are refused.
    try:
        return bool(value)
    except Exception as exc:  # e.g. a tensor of several elements
        raise ValueError(f"{name} should be a bool, but given {value!r} ({type(value).__name__})") from exc


class MasterFirst(Policy):
    """One rank runs the block first; the others wait for it, then run it (at the same time).

    Args:
        rank: the rank that goes first; with ``local=True`` a local rank, so one rank per node goes first.
        local: whether ``rank`` is a local rank (per node) or a global one.

    Examples:
        >>> from ignite_ext.distributed import MasterFirst, World
        >>> plan = MasterFirst(local=True).plan(World(4, (0, 0, 1, 1), (0, 1, 0, 1)), comm=None)
        >>> [bool(t) for t in plan.turns], [t.leader for t in plan.turns]
        ([True, False, True, False], [0, 0, 2, 2])

    .. versionadded:: 0.1.0
    """

    def __init__(self, rank: int = 0, local: bool = False) -> None:
        self.rank = rank
        self.local = local

    def __repr__(self) -> str:
        try:  # ranks that pass 0 and numpy.int64(0) pass the same policy
            return f"MasterFirst(rank={_check_int('rank', self.rank)}, local={_check_bool('local', self.local)})"
        except ValueError:
            return f"MasterFirst(rank={self.rank!r}, local={self.local!r})"

    def validate(self, world: World) -> None:
        """Check ``rank`` and ``local`` like ignite's ``one_rank_first`` does."""
        rank = _check_int("rank", self.rank)
        local = _check_bool("local", self.local)
        size = world.nproc_per_node() if local else world.world_size
        if rank >= size or rank < 0:
            # ignite's words first (code may match them), then what the numbers are and what to do.
            runs = f"{size} process{'es' if size != 1 else ''}"
            job = f"each node runs {runs} and local=True takes a local rank" if local else f"the job runs {runs}"
            raise ValueError(
                f"rank should be between 0 and {size - 1}, but given {rank}: {job}. Pass a rank from 0 to {size - 1}, "
                "or launch more processes (e.g. torchrun --nproc-per-node=4, or idist.Parallel(nproc_per_node=4))"
            )

    def plan(self, world: World, comm: Comm) -> Plan:
        """Put the chosen rank (of each node, with ``local=True``) first and make the others wait for it."""
        rank, local = _check_int("rank", self.rank), _check_bool("local", self.local)
        groups = world.nodes().values() if local else [tuple(range(world.world_size))]
        turns: dict[int, Turn] = {}
        for group in groups:
            # A node with fewer ranks than ``rank + 1`` has no such local rank: its lowest rank leads instead.
            leader = group[rank] if rank < len(group) else group[0]
            for r in group:
                after = frozenset() if r == leader else frozenset({leader})
                turns[r] = Turn(r, r == leader, after, group, leader)
        return Plan(tuple(turns[r] for r in range(world.world_size)))


class Ordered(Policy):
    """Ranks run the block one at a time, in rank order (with ``local=True``: within each node, nodes in parallel).

    Useful for readable output or for steps that must not run concurrently. Costs one small store
    operation per rank on native backends, and one collective per rank elsewhere.

    Args:
        local: order the ranks of each node separately, so the nodes proceed in parallel.

    Examples:
        >>> from ignite_ext.distributed import Ordered, World
        >>> plan = Ordered().plan(World(3, (0, 0, 0), (0, 1, 2)), comm=None)
        >>> [sorted(t.after) for t in plan.turns]
        [[], [0], [1]]

    .. versionadded:: 0.1.0
    """

    def __init__(self, local: bool = False) -> None:
        self.local = local

    def __repr__(self) -> str:
        try:
            return f"Ordered(local={_check_bool('local', self.local)})"
        except ValueError:
            return f"Ordered(local={self.local!r})"

    def validate(self, world: World) -> None:
        """Check that ``local`` is a bool."""
        _check_bool("local", self.local)

    def plan(self, world: World, comm: Comm) -> Plan:
        """Chain the ranks (of each node, with ``local=True``), each waiting for the previous one."""
        groups: Sequence[tuple[int, ...]] = (
            list(world.nodes().values()) if _check_bool("local", self.local) else [tuple(range(world.world_size))]
        )
        turns: dict[int, Turn] = {}
        for group in groups:
            for i, r in enumerate(group):
                after = frozenset({group[i - 1]}) if i else frozenset()
                turns[r] = Turn(r, i == 0, after, group, group[0])
        return Plan(tuple(turns[r] for r in range(world.world_size)))
