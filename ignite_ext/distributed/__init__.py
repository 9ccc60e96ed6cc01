"""A drop-in superset of :mod:`ignite.distributed`.

``import ignite_ext.distributed as idist`` gives every public name of ``ignite.distributed`` (the very same
objects) plus the rank scheduler: :func:`one_rank_first` (same arguments as ignite's, but failure-safe and
yielding whether this rank runs first), :func:`rank_scheduler` and its policies.

.. versionadded:: 0.1.0
"""

import importlib as _importlib

import ignite.distributed as _ignite_distributed
from ignite.distributed import *  # noqa: F403

# ignite.distributed imports Parallel without listing it in an __all__, so type checkers do not see it as
# exported through the star import above; name it explicitly (it is the very same class).
from ignite.distributed.launcher import Parallel as Parallel

from ignite_ext.distributed import _aliases, _torchrun_in_slurm
from ignite_ext.distributed.agreement import agree
from ignite_ext.distributed.errors import (
    CollectiveError,
    RankDiedError,
    RankFailedError,
    RankFailure,
    RankStalledError,
    StoreLostError,
)
from ignite_ext.distributed.liveness import watch_for_groups as _watch_for_groups
from ignite_ext.distributed.membership import job_store, lost_ranks
from ignite_ext.distributed.policies import Comm, MasterFirst, Ordered, Plan, Policy, Turn, World

# ignite's one_rank_first, which this one replaces, is typed as returning a generator context manager.
from ignite_ext.distributed.schedule import (  # type: ignore[assignment]
    at_block_end,
    current_block,
    one_rank_first,
    rank_scheduler,
)
from ignite_ext.distributed.shared_path import SharedPath
from ignite_ext.distributed.store import incarnation as _incarnation

__all__ = [
    "CollectiveError",
    "Comm",
    "MasterFirst",
    "Ordered",
    "Plan",
    "Policy",
    "RankDiedError",
    "RankFailedError",
    "RankFailure",
    "RankStalledError",
    "SharedPath",
    "StoreLostError",
    "Turn",
    "World",
    "agree",
    "at_block_end",
    "current_block",
    "job_store",
    "lost_ranks",
    "one_rank_first",
    "rank_scheduler",
]
# ignite.distributed has no __all__ of its own: its public names are what it exposes without a leading "_".
__all__ += sorted(n for n in dir(_ignite_distributed) if not n.startswith("_") and n not in __all__)

# The submodule paths of ignite.distributed resolve here too: ignite's very modules, but for ``utils``, which is a
# module of this package (ignite's names with the failure-safe one_rank_first).
_aliases.install()
# Under torchrun's agent store, each incarnation of a group forms on a store of its own (no attempt reads the
# peer addresses or block keys of the attempt before): torch's env:// rendezvous, wrapped before any group forms.
_incarnation.install()
# torchrun inside a Slurm job step: ignite reads torchrun's variables (the ranks), not Slurm's (the agents).
_torchrun_in_slurm.install()
# A rank beats from the moment its process group exists, so that dying before its first block is noticed.
_watch_for_groups()
# ``from ignite.distributed import *`` bound ignite's utils here: a plain ``from . import utils`` would return it.
utils = _importlib.import_module(f"{__name__}.utils")
