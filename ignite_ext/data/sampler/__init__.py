"""A distributed sampler whose shards stay put across epochs: :class:`ShardedDistributedSampler`.

The modules of this package:

* ``indices``: the index maths of a fresh epoch, as pure functions of ``(n, shards, shard, seed, epoch)``;
* ``mixing``: shards that exchange a fraction of their samples each epoch (``mix=``), as pure functions;
* ``layout``: :class:`~ignite_ext.data.sampler.layout.Layout`, how an epoch is dealt over a world (ranks, or
  nodes of ranks), and the sampler's arguments resolved into one with defaults from :mod:`ignite_ext.distributed`;
* ``restripe``: the rest of an epoch dealt over another world after a change of world size, as pure functions;
* ``resume``: the saved state (O(1) values per world the epoch ran on) and how it is read back;
* ``sharded``: :class:`ShardedDistributedSampler` itself;
* ``handlers``: :class:`SamplerHandler`, which keeps the sampler and an ignite Engine in step across resumes.

.. versionadded:: 0.1.0
"""

from ignite_ext.data.sampler.handlers import SamplerHandler
from ignite_ext.data.sampler.indices import node_shard_indices, samples_per_replica, shard_bounds, shard_indices
from ignite_ext.data.sampler.layout import Layout
from ignite_ext.data.sampler.restripe import Segment, restripe, unconsumed_indices
from ignite_ext.data.sampler.sharded import ShardedDistributedSampler

__all__ = [
    "Layout",
    "SamplerHandler",
    "Segment",
    "ShardedDistributedSampler",
    "node_shard_indices",
    "restripe",
    "samples_per_replica",
    "shard_bounds",
    "shard_indices",
    "unconsumed_indices",
]
