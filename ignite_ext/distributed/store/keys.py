"""Every key the package writes in a process group's store, with its lifetime: the one module that spells them.

Standard library only: the keeper loads it by its path. Every key lives under ``ignite_ext/`` (below the package's
namespace prefix where torch has no ``Store.clone``, see :mod:`ignite_ext.distributed.store.clients`; under torchrun's
agent store, in a store of the group's incarnation, see :func:`incarnation_prefix`); values are ASCII text (JSON,
decimal counters, or the codecs of :mod:`~ignite_ext.distributed.store.codecs`).

.. code-block:: text

    key                                  written by              deleted                          size
    ignite_ext/hb/<rank>                 rank's heartbeat thread never (one per rank per store)   counter
                                         (add; its watcher adds 0
                                         to create it), or its
                                         keeper for it
    ignite_ext/cuts                      whoever posts a cut     never (one per store)            counter
                                         (compare_set i-1 -> i)
    ignite_ext/cut/<i>                   the first proposer of   never (a few per failed job)     cut (codecs)
                                         cut i, once
    ignite_ext/proc/<rank>               rank, once its keeper   never (one per rank)             process identity
                                         is to start
    ignite_ext/namespace                 the group's first       never (one per store)            token
                                         process (compare_set)
    ignite_ext/wire_prefix               rank 0, once            never (one per store)            "p:" + prefix
    ignite_ext/probe/<uuid>              rank 0, to find torch's by rank 0 at once                "1"
                                         key prefix
    ignite_ext/proof/<pid>-<token>       each rank's proof of    by the proof at once             a few bytes
                                         the wire protocol
    ignite_ext/sched/<seq>/entry/<rank>  rank, on entering       by rank, after block seq+1's verdict   entry JSON
    ignite_ext/sched/<seq>/entered       every rank (add)        by rank 0, idem                  counter
    ignite_ext/sched/<seq>/verdict       the last rank to enter  by rank 0, idem                  verdict JSON
    ignite_ext/sched/<seq>/out/<rank>    rank (or who declares   by rank, idem                    outcome JSON
                                         it dead), once
    ignite_ext/sched/<seq>/exits         every rank (add)        by rank 0, idem                  exit count (codecs)
    ignite_ext/sched/<seq>/nfail         failing ranks (add)     by rank 0, idem                  counter
    ignite_ext/sched/<seq>/fail/<i>      the i-th failing rank   by that rank, idem               failures JSON
    ignite_ext/sched/<seq>/acks          every rank but 0 (add,  by rank 0, idem                  counter
                                         at its next beat)
    ignite_ext/sched/<seq>/acked         the last rank to ack    by rank 0, idem                  "1"
    ignite_ext/sched/<seq>/wake/<rank>/<phase>  whoever completes by rank, idem                   "w"/"t"
                                         what rank waits for in
                                         that phase (the verdict,
                                         its turn, every exit), or
                                         its heartbeat at a slice
                                         end
    ignite_ext/sched/<seq>/lost/<rank>   who finds rank silent   by that rank, idem               "1"
                                         after it posted its
                                         outcome, once
    ignite_ext/sched/<seq>/complete      who finds every outcome by rank 0, idem                  failures JSON
                                         posted after a loss
    ignite_ext/sched/<seq>/progress/<rank>  rank's heartbeat      by rank, idem (if written)       progress (codecs)
                                         thread, at a beat, while
                                         its progress changed and
                                         a rank waits for it
    ignite_ext/relay/<block>/<file>/...  the relay chain of      see the relay chain              small values
                                         download_for_job        (data.download._chain)

A block's keys are deleted only once the next block's verdict is known: block ``seq + 1`` is judged only after
every rank entered it, which proves every rank left block ``seq``. So at most two blocks' keys exist at a time.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

__all__ = [
    "CUTS_KEY",
    "NAMESPACE_KEY",
    "PHASES",
    "PREFIX_KEY",
    "ROOT",
    "BlockKeys",
    "cut_key",
    "heartbeat_key",
    "incarnation_prefix",
    "probe_key",
    "proc_key",
    "proof_key",
    "relay_key",
]


#: The root of every key of the package.
ROOT = "ignite_ext"


def incarnation_prefix(name: str) -> str:
    """The prefix under which one incarnation of a torchrun group keeps its keys, torch's and the package's.

    torchrun's agent keeps one store for every attempt of a job, and torch gives a restarted group no prefix of
    its own: :mod:`ignite_ext.distributed.store.incarnation` puts each incarnation's store under this one, so no
    attempt reads another's keys (gloo's peer addresses, a block's entries).

    Examples:
        >>> from ignite_ext.distributed.store.keys import incarnation_prefix
        >>> incarnation_prefix("round-2")
        'ignite_ext/incarnation/round-2'
    """
    return f"{ROOT}/incarnation/{name}"


#: How many cuts (ranks declared dead together) the group has: see :mod:`ignite_ext.distributed.liveness`.
CUTS_KEY = f"{ROOT}/cuts"

#: Where the processes of a group agree on the namespace of the package's keys (in the group's own store).
NAMESPACE_KEY = f"{ROOT}/namespace"

#: Where rank 0 publishes the prefix its group's keys carry on the wire (``p:`` and the prefix).
PREFIX_KEY = f"{ROOT}/wire_prefix"

#: The phases of a block in which a rank may wait, each with its own wake key: for the verdict (entry), for the ranks
#: its turn comes after (turn), for every rank to leave (exit).
PHASES = ("entry", "turn", "exit")


def heartbeat_key(rank: int) -> str:
    """The counter ``rank``'s heartbeat thread bumps while the process lives.

    Examples:
        >>> from ignite_ext.distributed.store.keys import heartbeat_key
        >>> heartbeat_key(3)
        'ignite_ext/hb/3'

    .. versionadded:: 0.4.0
    """
    return f"{ROOT}/hb/{rank}"


def cut_key(index: int) -> str:
    """The ranks of the group's ``index``-th cut (1-based), written once by the first rank that proposed it.

    Examples:
        >>> from ignite_ext.distributed.store.keys import cut_key
        >>> cut_key(1)
        'ignite_ext/cut/1'

    .. versionadded:: 0.4.0
    """
    return f"{ROOT}/cut/{index}"


def proc_key(rank: int) -> str:
    """Where ``rank`` publishes its process identity for the keepers of its host.

    Examples:
        >>> from ignite_ext.distributed.store.keys import proc_key
        >>> proc_key(3)
        'ignite_ext/proc/3'

    .. versionadded:: 0.4.0
    """
    return f"{ROOT}/proc/{rank}"


def probe_key(token: str) -> str:
    """A key rank 0 writes through torch's store and finds in the server's list, to learn torch's key prefix.

    Examples:
        >>> from ignite_ext.distributed.store.keys import probe_key
        >>> probe_key("ab12")
        'ignite_ext/probe/ab12'

    .. versionadded:: 0.4.0
    """
    return f"{ROOT}/probe/{token}"


def proof_key(token: str) -> str:
    """The key a rank's proof of the wire protocol writes, reads and deletes (one per process and proof).

    Examples:
        >>> from ignite_ext.distributed.store.keys import proof_key
        >>> proof_key("123-ab12")
        'ignite_ext/proof/123-ab12'

    .. versionadded:: 0.4.0
    """
    return f"{ROOT}/proof/{token}"


def relay_key(*parts: object) -> str:
    """A key of a relay chain of ``download_for_job`` (``ignite_ext.data.download._chain`` names its parts).

    Examples:
        >>> from ignite_ext.distributed.store.keys import relay_key
        >>> relay_key(3, "f00d")
        'ignite_ext/relay/3/f00d'

    .. versionadded:: 0.4.0
    """
    return "/".join([f"{ROOT}/relay", *map(str, parts)])


class BlockKeys:
    """The keys of scheduled block number ``seq`` (see the module docstring for who writes and deletes each).

    Args:
        seq: the block's sequence number in its process group.

    Examples:
        >>> from ignite_ext.distributed.store.keys import BlockKeys
        >>> keys = BlockKeys(7)
        >>> keys.outcome(2), keys.exits
        ('ignite_ext/sched/7/out/2', 'ignite_ext/sched/7/exits')
        >>> len(keys.deleted_by(0)), len(keys.deleted_by(1))
        (12, 5)

    .. versionadded:: 0.2.0
    """

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.prefix = f"{ROOT}/sched/{seq}"
        self.entered = f"{self.prefix}/entered"
        self.verdict = f"{self.prefix}/verdict"
        self.exits = f"{self.prefix}/exits"
        self.nfail = f"{self.prefix}/nfail"
        self.acks = f"{self.prefix}/acks"
        self.acked = f"{self.prefix}/acked"
        self.complete = f"{self.prefix}/complete"

    def entry(self, rank: int) -> str:
        """What ``rank`` passed on entering, for the last rank to enter to judge."""
        return f"{self.prefix}/entry/{rank}"

    def outcome(self, rank: int) -> str:
        """``rank``'s outcome: the failures it reports (empty when it succeeded); written once."""
        return f"{self.prefix}/out/{rank}"

    def fail(self, index: int) -> str:
        """The details of the ``index``-th failing rank (1-based, in the order they failed)."""
        return f"{self.prefix}/fail/{index}"

    def lost(self, rank: int) -> str:
        """Set by the rank that found ``rank`` silent after it had posted its outcome (it may not have left)."""
        return f"{self.prefix}/lost/{rank}"

    def wake(self, rank: int, phase: str) -> str:
        """The key ``rank`` blocks on while it waits in ``phase``; set by whoever completes what it waits for.

        One key per phase of the block (:data:`PHASES`): a waiter woken for what it waited for returns without
        deleting its key, which no later wait of the block uses.
        """
        return f"{self.prefix}/wake/{rank}/{phase}"

    def progress(self, rank: int) -> str:
        """How far ``rank`` got in the block (:func:`~ignite_ext.distributed.store.codecs.encode_progress`)."""
        return f"{self.prefix}/progress/{rank}"

    def deleted_by(self, rank: int) -> list[str]:
        """The keys of this block that ``rank`` deletes (not its ``fail/<i>`` and ``progress``: it carries those)."""
        own = [self.outcome(rank), self.entry(rank), *(self.wake(rank, phase) for phase in PHASES)]
        shared = [self.exits, self.nfail, self.acks, self.acked, self.entered, self.verdict, self.complete]
        return [*own, *shared] if rank == 0 else own
