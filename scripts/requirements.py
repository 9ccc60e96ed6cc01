"""Prints ``setup.py``'s requirements, one whole requirement a line, for the scripts that build environments.

A requirement may hold spaces (``'filelock>=3.20.3; sys_platform == "win32"'``), so the scripts read these lines
into an array (``mapfile -t``, see ``scripts/_requirements.sh``), never split them on white space.

Usage: python scripts/requirements.py [--extra NAME ...] [--without NAME ...]
  --extra NAME: also the requirements of that extra (``test``, ``dev``);
  --without NAME: leave out the requirements of that distribution (a script that pins it itself).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "setup.py"


def _literal(tree: ast.Module, name: str) -> object:
    """The literal a module-level name or a ``setup(...)`` keyword holds (``setup.py`` is never run)."""
    assigned = {
        t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == name:
            return _resolve(node.value, assigned)
    raise SystemExit(f"setup.py has no {name}")


def _resolve(node: ast.expr, assigned: dict[str, ast.expr]) -> object:
    if isinstance(node, ast.Name):
        return _resolve(assigned[node.id], assigned)
    if isinstance(node, ast.List):
        items: list[object] = []
        for element in node.elts:
            value = _resolve(element.value if isinstance(element, ast.Starred) else element, assigned)
            items += value if isinstance(element, ast.Starred) and isinstance(value, list) else [value]
        return items
    if isinstance(node, ast.Dict):
        return {
            _resolve(k, assigned): _resolve(v, assigned)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    return ast.literal_eval(node)


def requirements(extras: list[str], without: list[str]) -> list[str]:
    """``install_requires`` plus the ``extras``, less the distributions named in ``without``, as written."""
    tree = ast.parse(SETUP.read_text(encoding="utf-8"))
    found = list(_literal(tree, "install_requires"))  # type: ignore[call-overload]
    declared = _literal(tree, "extras_require")
    for extra in extras:
        found += declared[extra]  # type: ignore[index]
    skip = {name.lower() for name in without}
    return [r for r in found if re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() not in skip]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[])
    parser.add_argument("--without", action="append", default=[])
    args = parser.parse_args()
    print("\n".join(requirements(args.extra, args.without)))
