"""The submodule paths of ``ignite.distributed`` under ``ignite_ext.distributed``: ignite's very modules.

``import ignite_ext.distributed.comp_models.native`` must give ignite's ``native`` module itself, not a second copy
of it (two copies would hold two sets of classes and of module state). A finder on :data:`sys.meta_path` answers
for every name under the aliased prefixes with a loader that hands out the ignite module.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["install"]

_OURS = "ignite_ext.distributed."
_THEIRS = "ignite.distributed."
#: The submodules of ignite.distributed that are reached here as they are (``utils`` is a module of our own).
ALIASED = ("auto", "launcher", "comp_models")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(_THEIRS + spec.name.removeprefix(_OURS))

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is ignite's, already executed."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        rest = fullname.removeprefix(_OURS)
        if rest == fullname or rest.split(".", 1)[0] not in ALIASED:
            return None
        theirs = importlib.import_module(_THEIRS + rest)
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=hasattr(theirs, "__path__"))
        return spec


def install() -> None:
    """Put the finder on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
