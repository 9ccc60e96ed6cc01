"""The submodule paths of ``ignite.distributed`` under ``ignite_ext.distributed``: ignite's very modules.

``import ignite_ext.distributed.comp_models.native`` must give ignite's ``native`` module itself, not a second copy
of it (two copies would hold two sets of classes and of module state). Every such module that importing
``ignite.distributed`` loaded is entered in :data:`sys.modules` under the package's name too, and bound as an
attribute of its parent: plain entries, no import hook (``ignite.distributed`` imports all of its submodules).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import sys

__all__ = ["ALIASED", "install"]

_OURS = "ignite_ext.distributed"
_THEIRS = "ignite.distributed"
#: The submodules of ignite.distributed that are reached here as they are (``utils`` is a module of our own).
ALIASED = ("auto", "launcher", "comp_models")


def install() -> None:
    """Enter ignite's loaded submodules of :data:`ALIASED` (and theirs) under the package's names.

    Examples:
        >>> import sys
        >>> import ignite.distributed.comp_models.native as theirs
        >>> import ignite_ext.distributed
        >>> sys.modules["ignite_ext.distributed.comp_models.native"] is theirs
        True
        >>> ignite_ext.distributed.comp_models.native is theirs
        True
    """
    for name in sorted(sys.modules):  # parents before their children
        rest = name.removeprefix(_THEIRS + ".")
        if rest == name or rest.split(".", 1)[0] not in ALIASED:
            continue
        ours = f"{_OURS}.{rest}"
        module = sys.modules[name]
        sys.modules.setdefault(ours, module)
        parent, _, child = ours.rpartition(".")
        if parent in sys.modules and not hasattr(sys.modules[parent], child):
            setattr(sys.modules[parent], child, module)
