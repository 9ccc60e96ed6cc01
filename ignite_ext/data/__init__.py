"""Data helpers for distributed training: race-free downloads, a sharded sampler and a shared sample cache.

.. versionadded:: 0.1.0
"""

__all__: list[str] = []
