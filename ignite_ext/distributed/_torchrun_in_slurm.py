"""torchrun inside a Slurm job: torchrun's variables describe the ranks, Slurm's describe the agents.

ignite's native model reads Slurm's variables whenever ``SLURM_JOB_ID`` is set. It then checks torchrun's
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` against ``SLURM_PROCID``, ``SLURM_LOCALID`` and ``SLURM_NTASKS``. Under
``srun --ntasks-per-node=1 torchrun --nproc-per-node=2 ...`` those count torchrun's agents, not the ranks, and
ignite refuses a correct launch: "Environment variable defined for PyTorch Distributed context is inconsistent
with equivalent SLURM env variable. WORLD_SIZE: 4 vs 2" on two nodes, "LOCAL_RANK: 0 >= 1" with two agents on one.

:func:`install` wraps the two methods of ignite's native model that read Slurm's variables
(``setup_env_vars``, used by ``idist.Parallel`` and ``idist.initialize``, and ``_identify_local_rank``, used when the
group already exists). In a process torchrun started (``TORCHELASTIC_RUN_ID`` and torchrun's rank variables are
set), they run with ``SLURM_JOB_ID`` hidden, so ignite reads torchrun's variables as under any torchrun launch.
``SLURM_JOB_ID`` is back when they return, and in the environment ignite restores when the group ends. Anything
else, ``srun python train.py`` included, runs ignite's code unchanged.

.. versionadded:: 0.6.0
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["install", "launched_by_torchrun", "slurm_hidden"]

#: What torchrun sets in every process it starts (``torch.distributed.run``), besides ``TORCHELASTIC_RUN_ID``.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_WRAPPED = "__ignite_ext_torchrun_in_slurm__"


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process: its run id and rank variables are set.

    Examples:
        >>> import os
        >>> launched_by_torchrun() == all(k in os.environ for k in ("TORCHELASTIC_RUN_ID", *TORCHRUN_VARIABLES))
        True

    .. versionadded:: 0.6.0
    """
    return "TORCHELASTIC_RUN_ID" in os.environ and all(k in os.environ for k in TORCHRUN_VARIABLES)


@contextlib.contextmanager
def slurm_hidden() -> Iterator[dict[str, str]]:
    """Hide ``SLURM_JOB_ID`` from ignite's checks while inside, where torchrun started this process.

    Yields what it hid (empty where it hid nothing), and puts it back on the way out.

    Examples:
        >>> import os
        >>> with slurm_hidden() as hidden:
        ...     assert not hidden or "SLURM_JOB_ID" not in os.environ

    .. versionadded:: 0.6.0
    """
    hidden: dict[str, str] = {}
    # SLURM_JOB_ID: the variable every Slurm branch of ignite's native model tests.
    if "SLURM_JOB_ID" in os.environ and launched_by_torchrun():
        hidden["SLURM_JOB_ID"] = os.environ.pop("SLURM_JOB_ID")
    try:
        yield hidden
    finally:
        os.environ.update(hidden)


def install() -> None:
    """Wrap ignite's native model so that it reads torchrun's variables, not Slurm's, in a process torchrun started.

    Idempotent; does nothing where torch has no distributed support.

    Examples:
        >>> install()
        >>> install()  # a second call changes nothing

    .. versionadded:: 0.6.0
    """
    if not dist.is_available():
        return
    from ignite.distributed.comp_models.native import _NativeDistModel

    if getattr(_NativeDistModel.setup_env_vars, _WRAPPED, False):
        return
    setup: Callable[..., None] = _NativeDistModel.setup_env_vars
    identify: Callable[..., None] = _NativeDistModel._identify_local_rank

    @functools.wraps(setup)
    def setup_env_vars(self: Any, rank: int | None = None, world_size: int | None = None) -> None:
        with slurm_hidden() as hidden:
            setup(self, rank, world_size)
        if self._env_backup is not None:
            # ignite restores this copy when the group ends: the job's id must be in it.
            self._env_backup.update(hidden)

    @functools.wraps(identify)
    def _identify_local_rank(self: Any) -> None:
        with slurm_hidden():
            identify(self)

    setattr(setup_env_vars, _WRAPPED, True)
    _NativeDistModel.setup_env_vars = setup_env_vars  # type: ignore[method-assign]
    _NativeDistModel._identify_local_rank = _identify_local_rank  # type: ignore[method-assign]
