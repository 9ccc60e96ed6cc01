"""``ignite.distributed.utils`` with ignite_ext's failure-safe :func:`one_rank_first`: its other names are ignite's.

``import ignite_ext.distributed.utils as idist_utils`` works where code imported ``ignite.distributed.utils``;
``ignite_ext.distributed.auto``, ``.launcher`` and ``.comp_models`` are ignite's very modules.

Examples:
    >>> import ignite.distributed.utils as ignite_utils
    >>> import ignite_ext.distributed as idist
    >>> import ignite_ext.distributed.utils as utils
    >>> utils.one_rank_first is idist.one_rank_first, utils.get_rank is ignite_utils.get_rank
    (True, True)

.. versionadded:: 0.2.0
"""

import ignite.distributed.utils as _ignite_utils
from ignite.distributed.utils import *  # noqa: F403

# After the star import, which brought ignite's: this name is ignite_ext's.
from ignite_ext.distributed.schedule import one_rank_first as one_rank_first  # type: ignore[assignment]

__all__ = sorted({*getattr(_ignite_utils, "__all__", ()), "one_rank_first"})
