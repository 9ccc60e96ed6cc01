"""The package's contract with torch's store, in one room: what is here is all that knows torch's wire.

* :mod:`~ignite_ext.distributed.store.keys`: every key the package writes in the store, with who writes and who
  deletes it (the only module that spells one; a layering test holds it to that);
* :mod:`~ignite_ext.distributed.store.codecs`: the formats of the values that are more than JSON or a counter:
  cuts, and a block's exit count (exits, failures and losses in one counter);
* :mod:`~ignite_ext.distributed.store.wire`: a standard-library client of torch's TCPStore protocol (opcodes
  named after torch's ``QueryType``, one table per protocol flavour) and the start-up proof of every opcode used.

* :mod:`~ignite_ext.distributed.store.clients`: which store the package uses (the group's, or its own namespaced
  connections where torch has no ``Store.clone``), a client per thread, the small requests and the store errors of
  every torch admitted;
* :mod:`~ignite_ext.distributed.store.watchdog`: the watchdog that shuts down the connections to a store that
  leaves a request unanswered (it finds them in ``/proc/self/net/tcp``);
* :mod:`~ignite_ext.distributed.store.side`: the store made for backends that bring none (Horovod, XLA).

Keys, codecs and wire are standard library only (the keeper loads them by their paths). The room imports nothing
of the scheduler's protocol or of liveness, which stand on it (``tests/test_layering.py`` checks both).

Nothing starts or connects at import.

.. versionadded:: 0.4.0
"""

__all__: list[str] = []
