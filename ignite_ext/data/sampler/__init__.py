"""A distributed sampler whose shards stay put across epochs: :class:`ShardedDistributedSampler`.

The index maths lives in pure functions (:mod:`ignite_ext.data.sampler.indices`); the sampler class
(:mod:`ignite_ext.data.sampler.sharded`) adds arguments, defaults from :mod:`ignite_ext.distributed` and resumable
state.

.. versionadded:: 0.1.0
"""

from ignite_ext.data.sampler.indices import node_shard_indices, samples_per_replica, shard_bounds, shard_indices
from ignite_ext.data.sampler.sharded import ShardedDistributedSampler

__all__ = [
    "ShardedDistributedSampler",
    "node_shard_indices",
    "samples_per_replica",
    "shard_bounds",
    "shard_indices",
]
