"""The layering rules of docs/architecture.rst, checked on the import statements of the source tree.

* ``ignite_ext.distributed`` never imports ``ignite_ext.data`` (nor the demo);
* a capability subpackage of ``ignite_ext.data`` (``download``, ``sampler``, ``cache``) imports another one, and
  ``ignite_ext.distributed``, only through public modules (no ``_private`` module of another package);
* ``ignite_ext.errors``, ``ignite_ext._fs``, ``_locks`` and ``_slurm`` import nothing of the package but the errors;
* ``ignite_ext.settings``, the registry of the environment variables, imports nothing of the package, and every
  part of it may import the registry (the progress board, liveness and the store room included);
* the modules of the package import one another without a circle (imports inside functions count too);
* benchmarks and examples import neither ``tests`` nor any private module of the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ignite_ext"
CAPABILITIES = ("download", "sampler", "cache")
# Private modules of the top package that every part of it may use.
_BASE_MODULES = ("ignite_ext._fs", "ignite_ext._locks", "ignite_ext._slurm", "ignite_ext._version")
# The registry of the environment variables: every part of the package reads them through it, and it stands alone.
SETTINGS = "ignite_ext.settings"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` counts as ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def _private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def _owner(module: str) -> str:
    """The package a module belongs to for the layering: ``ignite_ext.data.<capability>`` or the top package."""
    parts = module.split(".")
    if parts[:2] == ["ignite_ext", "data"] and len(parts) > 2 and parts[2] in CAPABILITIES:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def _sources(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def violations() -> list[str]:
    found = []
    for path in _sources(PACKAGE):
        me = _module_name(path)
        owner = _owner(me)
        for target in imports(path):
            if not target.startswith("ignite_ext"):
                continue
            where = f"{path.relative_to(ROOT)} imports {target}"
            if me.startswith("ignite_ext.distributed") and target.startswith(("ignite_ext.data", "ignite_ext.demo")):
                found.append(f"{where}: distributed must not depend on data")
            if me in (
                "ignite_ext.errors",
                "ignite_ext._fs",
                "ignite_ext._locks",
                "ignite_ext._slurm",
            ) and not target.startswith("ignite_ext.errors"):
                found.append(f"{where}: the base modules import nothing of the package but the errors")
            if me == SETTINGS:
                found.append(f"{where}: the settings registry imports nothing of the package")
            if me.startswith("ignite_ext.progress") and not target.startswith(("ignite_ext.progress", SETTINGS)):
                found.append(f"{where}: progress stands alone (every capability reports to it)")
            if _owner(target) != owner and _private(target) and not target.startswith(_BASE_MODULES):
                found.append(f"{where}: another package's private module")
    for directory in ("benchmarks", "examples"):
        for path in _sources(ROOT / directory):
            for target in imports(path):
                if target == "tests" or target.startswith("tests."):
                    found.append(f"{path.relative_to(ROOT)} imports {target}: not from the tests")
                elif target.startswith("ignite_ext") and _private(target):
                    found.append(f"{path.relative_to(ROOT)} imports {target}: a private module")
    return found


def test_layering_rules_hold() -> None:
    assert violations() == []


def import_cycles(package: str) -> list[list[str]]:
    """The import circles among the modules of ``package`` (every import counts, those inside functions too)."""
    modules = {_module_name(p): p for p in _sources(PACKAGE) if _module_name(p).startswith(package)}
    edges: dict[str, set[str]] = {}
    for me, path in modules.items():
        targets = {t for t in imports(path) if t in modules and t != me}
        # ``from a import b`` names both a and a.b: where a.b is a module, the edge goes to it alone.
        edges[me] = {t for t in targets if not any(o.startswith(t + ".") and o in targets for o in targets)}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
    return cycles


def test_the_distributed_package_has_no_import_circle() -> None:
    assert import_cycles("ignite_ext.distributed") == []


def test_the_whole_package_has_no_import_circle() -> None:
    # A circle works only in the order the modules happen to be imported in (or only under TYPE_CHECKING): every
    # module of the package must stand on the ones below it.
    assert import_cycles("ignite_ext") == []


STORE_ROOM = "ignite_ext.distributed.store"
LIVENESS = "ignite_ext.distributed.liveness"
# The store room's modules the keeper loads by their paths: the standard library only.
STDLIB_ONLY = ("keys", "codecs", "wire")


def key_literals(path: Path, root: Path = ROOT) -> list[str]:
    """Where ``path`` spells a store key of the package: a string (or f-string) that starts with ``ignite_ext/``."""
    found = []
    nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
    parts = {id(part) for node in nodes if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in nodes:
        if id(node) in parts:
            continue  # an f-string's pieces: judged with the whole
        first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("ignite_ext/"):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {first.value!r}")
    return found


def store_room_violations() -> list[str]:
    """The store room's rules: keys spelled only in its keys module; it imports nothing of the scheduler's protocol
    or of liveness (nothing of the package outside it but ``ignite_ext.errors`` and ``ignite_ext.settings``); keys,
    codecs and wire import only the standard library. Liveness stands on the room alone: beats and cuts, nothing of
    the scheduler (whose chores ride on its thread as errands)."""
    found: list[str] = []
    for path in _sources(PACKAGE):
        me = _module_name(path)
        if me != f"{STORE_ROOM}.keys":
            found += key_literals(path)
        if me.startswith(LIVENESS):
            allowed = (LIVENESS, STORE_ROOM, "ignite_ext.errors", "ignite_ext._fs", SETTINGS)
            found += [
                f"{me} imports {target}: liveness stands on the store room only"
                for target in imports(path)
                if target.startswith("ignite_ext") and not target.startswith(allowed)
            ]
        if not me.startswith(STORE_ROOM):
            continue
        for target in imports(path):
            if target.startswith("ignite_ext") and not target.startswith((STORE_ROOM, "ignite_ext.errors", SETTINGS)):
                found.append(f"{me} imports {target}: the store room stands below the protocol and liveness")
            if me.rpartition(".")[2] in STDLIB_ONLY:
                top = target.split(".")[0]
                if top and top != "__future__" and top not in sys.stdlib_module_names:
                    found.append(f"{me} imports {target}: the keeper loads it by its path, standard library only")
    return found


def test_the_store_room_holds_every_key_and_stands_alone() -> None:
    assert store_room_violations() == []


def test_the_store_room_checker_sees_liveness_importing_the_scheduler() -> None:
    bad = PACKAGE / "distributed" / "liveness" / "_layering_probe.py"
    bad.write_text("from ignite_ext.distributed._lingering import Lingering\n")
    try:
        found = store_room_violations()
    finally:
        bad.unlink()
    assert found == [
        "ignite_ext.distributed.liveness._layering_probe imports ignite_ext.distributed._lingering: "
        "liveness stands on the store room only",
        "ignite_ext.distributed.liveness._layering_probe imports ignite_ext.distributed._lingering.Lingering: "
        "liveness stands on the store room only",
    ]


def test_the_store_room_checker_sees_a_key_outside_it(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text('KEY = "ignite_ext/hb/0"\nOTHER = f"ignite_ext/cut/{1}"\nFINE = "ignite_ext.errors"\n')
    found = [line.split(": ", 1)[1] for line in key_literals(stray, tmp_path)]
    assert found == ["'ignite_ext/hb/0'", "'ignite_ext/cut/'"]


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    # The rules must be able to fail: a distributed module importing data, and a private cross-package import.
    bad = PACKAGE / "distributed" / "_layering_probe.py"
    bad.write_text("from ignite_ext.data.cache import arena\nfrom ignite_ext.data.download._http import Validator\n")
    try:
        found = violations()
    finally:
        bad.unlink()
    assert any("distributed must not depend on data" in v for v in found), found
    assert any("private module" in v and "_http" in v for v in found), found


@pytest.mark.parametrize(
    ("statement", "absent"),
    [
        ("import ignite_ext.data", ("torch", "numpy", "ignite", "fcntl")),
        ("from ignite_ext.data import download_url, extract_archive, DownloadError", ("torch", "numpy", "ignite")),
        ("import ignite_ext.errors", ("torch", "numpy", "ignite")),
        ("import ignite_ext.settings", ("torch", "numpy", "ignite", "ignite_ext.distributed", "ignite_ext.data")),
        ("from ignite_ext import progress", ("torch", "numpy", "ignite", "ignite_ext.distributed")),
        ("import ignite_ext.__main__", ("torch", "numpy", "ignite", "tqdm", "filelock")),
    ],
)
def test_lazy_faces_import_nothing_heavy(statement: str, absent: tuple[str, ...]) -> None:
    code = f"import sys\n{statement}\nprint(sorted(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_lazy_face_loads_the_capability_on_first_use() -> None:
    code = (
        "import sys, ignite_ext.data as d\n"
        "assert 'torch' not in sys.modules\n"
        "from ignite_ext.data import ShardedDistributedSampler\n"
        "print('torch' in sys.modules, ShardedDistributedSampler.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "ignite_ext.data.sampler.sharded"]


def test_the_download_path_imports_without_fcntl() -> None:
    # What Windows lacks: with fcntl unimportable, the download helpers and the CLI still import and parse.
    code = (
        "import sys\n"
        "sys.modules['fcntl'] = None\n"
        "from ignite_ext.data import download_url, extract_archive\n"
        "from ignite_ext.__main__ import main\n"
        "print(main(['--version']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split()[-1] == "0", out.stdout


def test_cli_help_is_plain_text_and_fast() -> None:
    for args in (["--help"], ["download", "--help"], ["--version"]):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "ignite_ext", *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert "``" not in out.stdout and ".. " not in out.stdout and ":func:" not in out.stdout, out.stdout
        loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
        assert not loaded & {"torch", "numpy", "ignite", "tqdm", "filelock"}, sorted(loaded)


CACHE = "ignite_ext.data.cache"
# The arena's rooms and what of the cache each may import: downwards only (the space policies know nothing of the
# table or the counters, the table nothing of the space's bookkeeping, none of them the file's life or the arena).
ARENA_ROOMS = {
    "_mapping": {"_cow"},
    "_follow": {"_mapping"},
    "_space": {"_cow", "_follow", "_mapping"},
    "_table": {"_cow", "_mapping"},
    "_counters": {"_mapping"},
    "_life": {"_counters", "_cow", "_follow", "_mapping", "_space", "_sigterm", "persist", "restart", "shm"},
    "arena": {"_counters", "_life", "_mapping", "_space", "_table"},
}


def test_the_arenas_rooms_import_only_downwards() -> None:
    found = []
    for room, allowed in ARENA_ROOMS.items():
        for target in imports(PACKAGE / "data" / "cache" / f"{room}.py"):
            if target.startswith(f"{CACHE}.") and target.split(".")[3] not in allowed:
                found.append(f"{room} imports {target}")
    assert found == []


#: The cache folder's lines when its arena was split into rooms (0.5.0): a redesign does not grow it.
CACHE_LINES = 4_446
#: Lines of code (no docstring, comment or blank line) a class may have: above it, it holds more than one concern.
CLASS_CODE_LINES = 300


def _code_lines(source: str, node: ast.ClassDef) -> int:
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(inner):
            first = inner.body[0]
            docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    text = source.splitlines()
    rows = set(range(node.lineno, (node.end_lineno or node.lineno) + 1)) - docstrings
    return sum(1 for row in rows if text[row - 1].strip() and not text[row - 1].strip().startswith("#"))


def test_the_cache_keeps_its_size_and_every_class_one_concern() -> None:
    lines = sum(len(path.read_text().splitlines()) for path in (PACKAGE / "data" / "cache").glob("*.py"))
    assert lines <= CACHE_LINES, f"ignite_ext/data/cache/ has {lines} lines, over its {CACHE_LINES}"
    large = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (size := _code_lines(source, node)) > CLASS_CODE_LINES:
                large.append(f"{path.relative_to(ROOT)}: {node.name} ({size} lines of code)")
    assert large == []
