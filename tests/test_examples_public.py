"""The scripts in ``examples/`` use only the package's public names: users copy them, internals and all.

A name is public when its module path has no part that starts with an underscore, is not under
``ignite_ext.demo`` (the demo's own helpers), and is in its module's ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.py"))


def _internal(dotted: str) -> bool:
    """Whether ``ignite_ext...`` names an internal module or name (a dunder such as ``__version__`` is public)."""
    parts = dotted.split(".")
    private = any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)
    return private or parts[:2] == ["ignite_ext", "demo"]


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything else than names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        head = _chain(node.value)
        return None if head is None else [*head, node.attr]
    return None


def package_names(source: str) -> list[str]:
    """Every ``ignite_ext`` name ``source`` uses, dotted: imports, attributes of imported names, module strings.

    >>> package_names("import ignite_ext.distributed as idist\\nidist.one_rank_first()")
    ['ignite_ext.distributed', 'ignite_ext.distributed.one_rank_first']
    """
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # a local name -> the ignite_ext name it stands for
    used: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ignite_ext":
                    used.append(alias.name)
                    bound[alias.asname or "ignite_ext"] = alias.name if alias.asname else "ignite_ext"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ignite_ext"):
            for alias in node.names:
                used.append(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in bound:
            used.append(".".join([bound[chain[0]], *chain[1:]]))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            used += re.findall(r"\bignite_ext(?:\.\w+)+", node.value)  # importlib.import_module("ignite_ext....")
    return list(dict.fromkeys(used))


def _not_exported(dotted: str) -> str | None:
    """Why ``dotted`` is not a public name of its module, or None: it must be a module or in its ``__all__``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix is the module
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        if cut == len(parts):
            return None
        exported = getattr(module, "__all__", None)
        name = parts[cut]
        if exported is not None and name not in exported and not (name.startswith("__") and name.endswith("__")):
            return f"{name} is not in {module.__name__}.__all__"
        return None
    return "no such module"


@pytest.mark.parametrize(
    ("source", "internal"),
    [
        ("from ignite_ext.demo.data import CountingServer", ["ignite_ext.demo.data.CountingServer"]),
        ("import ignite_ext.data._locks", ["ignite_ext.data._locks"]),
        (
            "from ignite_ext import _locks as locks\nlocks.RecordLock",
            ["ignite_ext._locks", "ignite_ext._locks.RecordLock"],
        ),
        (
            "import ignite_ext.distributed as idist\nidist._state.x",
            ["ignite_ext.distributed._state.x", "ignite_ext.distributed._state"],
        ),
        ("import importlib\nimportlib.import_module('ignite_ext.demo')", ["ignite_ext.demo"]),
        ("import ignite_ext\nignite_ext.__version__", []),
    ],
)
def test_the_check_finds_internal_names(source: str, internal: list[str]) -> None:
    assert [n for n in package_names(source) if _internal(n)] == internal


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_use_only_public_names(path: Path) -> None:
    names = package_names(path.read_text(encoding="utf-8"))
    assert names, f"{path.name} uses nothing of ignite_ext"
    assert [n for n in names if _internal(n)] == [], f"{path.name} uses internal names"
    hidden = {n: why for n in names if (why := _not_exported(n)) is not None}
    assert hidden == {}, f"{path.name} uses names its modules do not export"
