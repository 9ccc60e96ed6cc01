"""Keep a :class:`~ignite_ext.data.ShardedDistributedSampler` in step with an ignite Engine: :class:`SamplerHandler`.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

from typing import Any

from ignite.engine import Engine, Events

from ignite_ext.data.sampler.sharded import ShardedDistributedSampler

__all__ = ["SamplerHandler"]


class SamplerHandler:
    """Drive a sampler from an ignite :class:`~ignite.engine.Engine`, so a checkpoint resumes it on any world.

    Attached to the engine that iterates ``loader``:

    * ``EPOCH_STARTED``: ``sampler.set_epoch(engine.state.epoch - 1)`` (the epoch of a loaded state keeps its
      position);
    * ``ITERATION_STARTED``: :meth:`~ignite_ext.data.ShardedDistributedSampler.set_consumed` with the batches
      the loop has taken, so a state saved at ``ITERATION_COMPLETED`` counts what was trained on, however far
      the DataLoader's workers prefetched (any ``num_workers``);
    * ``STARTED`` of a run resumed from a checkpoint: the engine's count is made to fit the sampler on this world.
      Ignite keeps the saved ``epoch_length`` and counts the rest of the epoch from it, which after a change of
      world size is another number of batches than the sampler yields (too few would skip samples, too many
      would restart the loader and repeat them). So ``engine.state.epoch_length`` becomes ``len(loader)`` and
      ``engine.state.iteration`` becomes what it would be had the run always had this world's epoch length:
      ``epoch * len(loader)`` plus the batches of the epoch already done, ``len(loader)`` minus the batches of
      :meth:`~ignite_ext.data.ShardedDistributedSampler.remaining_indices`. On the world the checkpoint was
      saved on, nothing changes. Handlers keyed on the iteration count (``every=``, checkpoint names) count
      on from there.

    One engine epoch must be one pass over ``loader`` (``epoch_length == len(loader)``, the default). Load the
    checkpoint (engine and sampler together) before ``engine.run``. Attach the handler on every rank: it keeps
    the ranks' counts equal, as the DDP lockstep needs.

    Args:
        sampler: the loader's sampler.
        loader: the DataLoader that ``engine.run`` iterates; its ``batch_size`` and ``drop_last`` turn samples
            into batches.

    Raises:
        ValueError: ``loader`` has no ``batch_size`` (a custom ``batch_sampler``), or does not use ``sampler``.

    Examples:
        >>> from ignite.engine import Engine, Events
        >>> from torch.utils.data import DataLoader
        >>> from ignite_ext.data import ShardedDistributedSampler
        >>> from ignite_ext.data.sampler import SamplerHandler
        >>> sampler = ShardedDistributedSampler(range(20), num_replicas=2, rank=0)
        >>> loader = DataLoader(range(20), batch_size=4, sampler=sampler)
        >>> trainer = Engine(lambda engine, batch: None)
        >>> SamplerHandler(sampler, loader).attach(trainer)
        >>> _ = trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda engine: engine.terminate())
        >>> _ = trainer.run(loader, max_epochs=1)  # stops after 2 of the 3 batches
        >>> state = sampler.state_dict()  # what a Checkpoint at ITERATION_COMPLETED would save
        >>> state["consumed"]
        8
        >>> # ... the job stops; a world of 4 ranks loads {"trainer": ..., "sampler": ...} from the checkpoint:
        >>> new = ShardedDistributedSampler(range(20), num_replicas=4, rank=0)
        >>> new.load_state_dict(state)
        >>> new_loader = DataLoader(range(20), batch_size=4, sampler=new)
        >>> resumed = Engine(lambda engine, batch: None)
        >>> resumed.load_state_dict({"iteration": 2, "epoch_length": 3, "max_epochs": 2})
        >>> SamplerHandler(new, new_loader).attach(resumed)
        >>> _ = resumed.run(new_loader)
        >>> resumed.state.epoch_length, resumed.state.iteration  # 1 batch of the epoch left, then 1 more epoch
        (2, 4)

    .. versionadded:: 0.2.0
    """

    def __init__(self, sampler: ShardedDistributedSampler, loader: Any) -> None:
        if getattr(loader, "batch_size", None) is None:
            raise ValueError("SamplerHandler needs a DataLoader with a batch_size (not a custom batch_sampler)")
        if getattr(loader, "sampler", None) is not sampler:
            raise ValueError("the loader does not draw its indices from this sampler")
        self.sampler = sampler
        self.loader = loader
        self._offset = 0  # where the current pass of the sampler starts: a loaded position, or 0
        self._batches = 0  # batches the loop has taken in the current pass

    def _to_batches(self, samples: int) -> int:
        size: int = self.loader.batch_size
        return samples // size if self.loader.drop_last else -(-samples // size)

    def attach(self, engine: Engine) -> None:
        """Attach the handlers to ``engine`` (see the class)."""
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.ITERATION_STARTED, self._iteration_started)

    def _started(self, engine: Engine) -> None:
        state, per_epoch = engine.state, len(self.loader)
        if state.iteration == 0:
            if state.epoch_length not in (None, per_epoch):
                raise ValueError(
                    f"SamplerHandler needs one engine epoch per pass over the loader: epoch_length="
                    f"{state.epoch_length}, len(loader)={per_epoch}"
                )
            return
        if self.sampler.epoch == state.epoch:
            # The loaded state is in the middle of the epoch the engine resumes (state.epoch counts the epochs
            # done, the sampler's epoch is 0-based): give the engine the batches the sampler has left.
            left = self._to_batches(len(self.sampler.remaining_indices()))
            if left == 0:  # nothing left of it on this world: the epoch is over
                state.epoch += 1
            state.iteration = state.epoch * per_epoch + (per_epoch - left if left else 0)
        elif state.epoch_length != per_epoch:
            state.iteration = state.epoch * per_epoch
        state.epoch_length = per_epoch

    def _epoch_started(self, engine: Engine) -> None:
        self.sampler.set_epoch(engine.state.epoch - 1)
        self._offset = self.sampler.state_dict()["consumed"]
        self._batches = 0

    def _iteration_started(self, engine: Engine) -> None:
        self._batches += 1
        self.sampler.set_consumed(self._offset + self._batches * self.loader.batch_size)
