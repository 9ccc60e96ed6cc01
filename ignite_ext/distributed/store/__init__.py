"""The package's contract with torch's store, in one room: what is here is all that knows torch's wire.

* :mod:`~ignite_ext.distributed.store.wire`: a standard-library client of torch's TCPStore protocol (opcodes
  named after torch's ``QueryType``, one table per protocol flavour) and the start-up proof of every opcode used.

Nothing starts or connects at import.

.. versionadded:: 0.4.0
"""

__all__: list[str] = []
