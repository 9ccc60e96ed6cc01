"""The sampler's saved state: what it holds, how it is read back on the same world or another one.

A state is plain values, the same on every rank (ranks train in lockstep), so the copy rank 0 saves can be
loaded by every rank of the next world, whatever its size::

    {"epoch": 3, "consumed": 40,                          # position of the current segment, on every rank
     "dataset_len": 1000, "seed": 0, "shuffle": True, "drop_last": False, "mix": 0.0,   # must match
     "num_replicas": 4, "shard_by": "rank", "num_shards": 4,                  # the world it was saved on
     "history": [{"num_replicas": 8, "shard_by": "rank", "num_shards": 8, "consumed": 25}]}

``history`` lists the epoch's earlier worlds with what each rank of them consumed (oldest first; empty unless the
world changed during the epoch): O(1) values per change of world size, never index lists. Reading it back
(:func:`read_state`):

* on the world it was saved on: the same position, continued;
* on another world (``num_replicas``, ``shard_by`` or the node count changed): the saved world becomes one more
  segment of ``history`` and the rest of the epoch is restriped over the new world
  (:mod:`ignite_ext.data.sampler.restripe`), from its start;
* with another ``dataset_len``, ``seed``, ``shuffle``, ``drop_last`` or ``mix``: a ``ValueError``, since the
  positions would name other samples. States without those keys (written by 0.1.0) are taken as matching, except
  ``mix``: a state without it (written before 0.4.0) mixed nothing.

With ``mix``, the epoch's first world dealt its mixed shards (:func:`~ignite_ext.data.sampler.mixing.epoch_pool`
of that world's shard count), which the replay recomputes; the next epochs mix on the new world, from the same
``(seed, epoch)`` schedule.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ignite_ext.data.sampler.indices import check_int
from ignite_ext.data.sampler.layout import Layout
from ignite_ext.data.sampler.restripe import Segment, restripe
from ignite_ext.distributed.agreement import disagreement

__all__ = ["Config", "Position", "read_state", "resumed_order", "same_everywhere", "write_state"]

_CONFIG_KEYS = ("dataset_len", "seed", "shuffle", "drop_last", "mix")


class Config(NamedTuple):
    """What a state must have been saved with to be loaded: the dataset's length and the sampler's options."""

    dataset_len: int
    seed: int
    shuffle: bool
    drop_last: bool
    mix: float = 0.0


@dataclass(frozen=True)
class Position:
    """Where an epoch stands on the current world: its earlier segments and the current segment's position."""

    epoch: int
    history: tuple[Segment, ...]
    consumed: int

    def describe(self) -> str:
        """A short, rank-independent summary, to compare what the ranks loaded."""
        worlds = "".join(f"{s.layout.num_replicas}:{s.consumed}," for s in self.history)
        return f"epoch {self.epoch}, consumed {self.consumed}, earlier worlds [{worlds.rstrip(',')}]"


def write_state(config: Config, layout: Layout, position: Position) -> dict[str, Any]:
    """Return the state of ``position`` on ``layout`` as plain values (the format above).

    Examples:
        >>> from ignite_ext.data.sampler.layout import Layout
        >>> from ignite_ext.data.sampler.resume import Config, Position, write_state
        >>> state = write_state(Config(10, 0, True, False), Layout(2), Position(1, (), 3))
        >>> state["epoch"], state["consumed"], state["num_replicas"], state["history"]
        (1, 3, 2, [])

    .. versionadded:: 0.2.0
    """
    return {
        "epoch": position.epoch,
        "consumed": position.consumed,
        **config._asdict(),
        **layout.as_state(),
        "history": [{**s.layout.as_state(), "consumed": s.consumed} for s in position.history],
    }


def _history(raw: object, default: Layout) -> tuple[Segment, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise ValueError(f"a sampler state's history must be a list of segments, got {type(raw).__name__}")
    segments = []
    for item in raw:
        if not isinstance(item, Mapping) or "consumed" not in item or "num_replicas" not in item:
            raise ValueError(f"a history segment needs num_replicas and consumed, got {item!r}")
        segments.append(Segment(Layout.from_state(item, default), check_int("consumed", item["consumed"], 0)))
    return tuple(segments)


def read_state(state: Mapping[str, Any], config: Config, layout: Layout) -> Position:
    """Read a saved state as a position on ``layout``: the same one, or the rest of its epoch restriped.

    Only the values are checked here; how far each segment's ranks got is checked against their lengths when
    the order is computed (:func:`resumed_order`).

    Args:
        state: what ``state_dict()`` returned (``epoch`` and ``consumed`` required, the rest optional).
        config: this sampler's dataset length and options.
        layout: this sampler's world.

    Returns:
        The position to continue from on ``layout``.

    Raises:
        ValueError: a key is missing or malformed, or the state was saved with another ``dataset_len``,
            ``seed``, ``shuffle``, ``drop_last`` or ``mix`` (a state without ``mix`` was saved with none).
        TypeError: ``epoch`` or ``consumed`` is not an int.

    Examples:
        >>> from ignite_ext.data.sampler.layout import Layout
        >>> from ignite_ext.data.sampler.resume import Config, read_state
        >>> saved = {"epoch": 2, "consumed": 5, "num_replicas": 4, "shard_by": "rank", "num_shards": 4}
        >>> read_state(saved, Config(100, 0, True, False), Layout(4)).describe()
        'epoch 2, consumed 5, earlier worlds []'
        >>> read_state(saved, Config(100, 0, True, False), Layout(2)).describe()  # resumed on 2 ranks
        'epoch 2, consumed 0, earlier worlds [4:5]'

    .. versionadded:: 0.2.0
    """
    missing = [key for key in ("epoch", "consumed") if key not in state]
    if missing:
        raise ValueError(f"not a ShardedDistributedSampler state: missing {missing}")
    epoch = check_int("epoch", state["epoch"])
    consumed = check_int("consumed", state["consumed"], 0)
    mine = config._asdict()
    saved_config = {"mix": 0.0, **state}  # a state saved before mixing existed mixed nothing
    changed = [key for key in _CONFIG_KEYS if key in saved_config and saved_config[key] != mine[key]]
    if changed:
        saved = ", ".join(f"{key}={saved_config[key]!r}" for key in changed)
        now = ", ".join(f"{key}={mine[key]!r}" for key in changed)
        raise ValueError(
            f"the sampler state was saved with {saved}, this sampler has {now}: its positions name other samples. "
            "To start afresh, leave the sampler out of the objects loaded from the checkpoint"
        )
    saved_layout = Layout.from_state(state, layout)
    history = _history(state.get("history", ()), layout)
    if saved_layout == layout:
        return Position(epoch, history, consumed)
    # A segment in which nothing was consumed changed nothing: leave it out, so that worlds which come and go
    # before training resumes do not grow the state.
    if consumed:
        history += (Segment(saved_layout, consumed),)
    return Position(epoch, history, 0)


def resumed_order(config: Config, layout: Layout, shard: int, local: int, position: Position) -> list[int] | None:
    """Return this rank's order for the rest of ``position``'s epoch, or None for the fixed-shard order.

    Also checks the position against the lengths of its segments, so a state that no world could have written
    is refused before any index is yielded.

    Raises:
        ValueError: a segment's (or the current) ``consumed`` is more than its ranks' length.

    .. versionadded:: 0.2.0
    """
    order = None
    length = layout.length(config.dataset_len, config.drop_last)
    if position.history:
        order = restripe(
            config.dataset_len,
            position.history,
            layout,
            shard,
            local,
            seed=config.seed,
            epoch=position.epoch,
            drop_last=config.drop_last,
            shuffle=config.shuffle,
            mix=config.mix,
        )
        length = len(order)
    if position.consumed > length:
        raise ValueError(
            f"consumed={position.consumed} is more than the {length} indices of epoch {position.epoch} on "
            f"{layout.num_replicas} ranks"
        )
    return order


def same_everywhere(keys: list[str]) -> str | None:
    """The ``check`` of the agreement on a load: what each rank loaded (:meth:`Position.describe` and its sampler).

    Examples:
        >>> from ignite_ext.data.sampler.resume import same_everywhere
        >>> same_everywhere(["epoch 1", "epoch 1"]) is None
        True
        >>> same_everywhere(["epoch 1", "epoch 2"])
        'the ranks loaded different states (or have different samplers): ranks [0]: epoch 1; ranks [1]: epoch 2'

    .. versionadded:: 0.2.0
    """
    found = disagreement(keys)
    return None if found is None else f"the ranks loaded different states (or have different samplers): {found}"
