"""The settings registry (``ignite_ext/settings.py``): every variable the package reads is in it, read through it,
with the defaults and parsing it had before, a clear error on a bad value, and a row in the docs' tables."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ignite_ext import settings
from ignite_ext.settings import INTERNAL, REGISTRY, USER

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ignite_ext"
REGISTRY_MODULE = PACKAGE / "settings.py"
NAME = re.compile(r"IGNITE_EXT_\w+")
# A string that is a variable's name, or the start of one built from pieces.
SPELLED = re.compile(r"IGNITE_EXT_\w*")
# Readers of the environment, by how they are spelled: os.environ.get(...), os.getenv(...), os.environ[...].
READERS = {("environ", "get"), ("environ", "pop"), ("environ", "setdefault"), ("os", "getenv")}
# Where the package reads the environment by a name it is given, not one it spells: a public helper for the
# user's own variables (the package's are read through the registry).
GENERIC_READERS = {"ignite_ext/distributed/liveness/settings.py:env_float"}

#: The defaults as the package had them before the registry (0.5.0), read site by read site.
DEFAULTS_BEFORE: dict[str, Any] = {
    "IGNITE_EXT_HEARTBEAT_TIMEOUT": 10.0,
    "IGNITE_EXT_STALL_TIMEOUT": 600.0,
    "IGNITE_EXT_WAIT_LOG_INTERVAL": 30.0,
    "IGNITE_EXT_WAITING_LINE": True,
    "IGNITE_EXT_STORE_WATCHDOG": True,
    "IGNITE_EXT_STORE_ADDR": None,
    "IGNITE_EXT_STORE_PORT": 0,
    "IGNITE_EXT_STORE_CONNECT_TIMEOUT": 30.0,
    "IGNITE_EXT_RELAY": True,
    "IGNITE_EXT_RELAY_ADDR": None,
    "IGNITE_EXT_RELAY_PORTS": range(0, 1),
    "IGNITE_EXT_DOWNLOAD_BACKOFF_S": 1.0,
    "IGNITE_EXT_PERSIST_BYTES": None,
    "IGNITE_EXT_SCHEDULER_CHANNEL": "auto",
    "IGNITE_EXT_EARLY_HEARTBEAT": True,
    "IGNITE_EXT_PROCESS_WATCH": True,
    "IGNITE_EXT_PROGRESS_BOARD": None,
}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p != REGISTRY_MODULE)


def named_variables(root: Path = PACKAGE) -> dict[str, list[str]]:
    """Every ``IGNITE_EXT_*`` name the package's source mentions (code, docstrings, comments), with where."""
    found: dict[str, list[str]] = {}
    for path in (p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in NAME.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(root.parent)}:{number}")
    return found


def _enclosing(tree: ast.AST) -> dict[int, str]:
    """The function each node is in, by the node's id."""
    owner: dict[int, str] = {}
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                owner.setdefault(id(node), function.name)  # the outermost function: walk sees it first
    return owner


def _environ_key(node: ast.AST) -> ast.expr | None:
    """The name an environment read asks for (``os.environ.get(k)``, ``os.getenv(k)``, ``os.environ[k]``), or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        base = node.func.value
        base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        return node.args[0] if (base_name, node.func.attr) in READERS else None
    environ = isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ"
    return node.slice if environ and isinstance(node.ctx, ast.Load) else None


def bypasses(path: Path, root: Path = ROOT) -> list[str]:
    """Where ``path`` reads or names a package variable around the registry.

    * a string (or a piece of an f-string) that is an ``IGNITE_EXT_...`` name, or its start: docstrings and
      messages may mention a variable, code may not spell one (it takes the name from the registry);
    * a read of the environment (``os.environ.get``, ``os.getenv``, ``os.environ[...]``) by a name that is not a
      plain string: such a read could take a package variable's name from anywhere.
    """
    where = str(path.relative_to(root))
    tree = ast.parse(path.read_text(), where)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    owner = _enclosing(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        text = node.value if isinstance(node, ast.Constant) and id(node) not in docstrings else None
        if isinstance(text, str) and SPELLED.match(text) and " " not in text:
            found.append((node.lineno, f"spells {text!r}"))
        key = _environ_key(node)
        named = isinstance(key, ast.Constant) and isinstance(key.value, str)
        if key is not None and not named and f"{where}:{owner.get(id(node), '')}" not in GENERIC_READERS:
            found.append((node.lineno, "reads the environment by a computed name"))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def test_every_variable_the_package_names_is_registered() -> None:
    unknown = {name: where for name, where in named_variables().items() if name not in REGISTRY}
    assert unknown == {}, f"variables the package names but ignite_ext/settings.py does not register: {unknown}"


def test_the_package_reads_variables_only_through_the_registry() -> None:
    found = [line for path in _sources() for line in bypasses(path)]
    assert found == [], "read ignite_ext/settings.py's Setting.read() instead:\n" + "\n".join(found)


def test_the_checker_sees_a_read_around_the_registry(tmp_path: Path) -> None:
    # The rules must be able to fail: a new variable read directly, by pieces, by a computed name, in a docstring.
    stray = tmp_path / "ignite_ext" / "stray.py"
    stray.parent.mkdir()
    stray.write_text(
        '"""Mentions IGNITE_EXT_FROM_A_DOCSTRING, which is no setting."""\n'
        "import os\n"
        'A = os.environ.get("IGNITE_EXT_NEW")\n'
        'B = os.getenv("IGNITE_EXT_" + "OTHER")\n'
        'C = os.environ[f"IGNITE_EXT_{A}"]\n'
        'NAME = "IGNITE_EXT_THIRD"\n'
        "D = os.environ.get(NAME, '1')\n"
        'FINE = os.environ.get("LOCAL_RANK", "0"), "set IGNITE_EXT_RELAY=0 to turn it off"\n'
    )
    assert bypasses(stray, tmp_path) == [
        "ignite_ext/stray.py:3: spells 'IGNITE_EXT_NEW'",
        "ignite_ext/stray.py:4: reads the environment by a computed name",
        "ignite_ext/stray.py:4: spells 'IGNITE_EXT_'",
        "ignite_ext/stray.py:5: reads the environment by a computed name",
        "ignite_ext/stray.py:5: spells 'IGNITE_EXT_'",
        "ignite_ext/stray.py:6: spells 'IGNITE_EXT_THIRD'",
        "ignite_ext/stray.py:7: reads the environment by a computed name",
    ]
    assert set(named_variables(stray.parent)) - set(REGISTRY) == {
        "IGNITE_EXT_FROM_A_DOCSTRING",
        "IGNITE_EXT_NEW",
        "IGNITE_EXT_THIRD",
    }


def test_each_setting_says_what_the_docs_need() -> None:
    for name, setting in REGISTRY.items():
        assert setting.name == name and setting.audience in (USER, INTERNAL), name
        assert setting.unit and setting.accepts and setting.shown_default(), name
        sentence = re.sub(r":term:`([^`<]+?)\s*(<[^>]*>)?`", r"\1", setting.changes)  # as the page shows it
        assert sentence.endswith(".") and sentence.count(". ") == 0 and len(sentence.split()) <= 18, name


def test_the_defaults_are_those_the_code_had() -> None:
    assert set(REGISTRY) == set(DEFAULTS_BEFORE)
    for name, default in DEFAULTS_BEFORE.items():
        assert settings.get(name, environ={}) == default, name
        assert REGISTRY[name].default == default, name


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        # The timeouts took text that is not a number as unset, and still do.
        ("IGNITE_EXT_HEARTBEAT_TIMEOUT", "3", 3.0),
        ("IGNITE_EXT_HEARTBEAT_TIMEOUT", "3s", 10.0),
        ("IGNITE_EXT_HEARTBEAT_TIMEOUT", "", 10.0),
        ("IGNITE_EXT_STALL_TIMEOUT", "inf", math.inf),
        ("IGNITE_EXT_STORE_CONNECT_TIMEOUT", "soon", 30.0),
        ("IGNITE_EXT_WAIT_LOG_INTERVAL", " 5 ", 5.0),
        # Switches: only 0 is off (the waiting line takes off, no and false too).
        ("IGNITE_EXT_RELAY", "0", False),
        ("IGNITE_EXT_RELAY", "off", True),
        ("IGNITE_EXT_PROCESS_WATCH", "", True),
        ("IGNITE_EXT_WAITING_LINE", " Off ", False),
        ("IGNITE_EXT_WAITING_LINE", "1", True),
        ("IGNITE_EXT_SCHEDULER_CHANNEL", "Collective", "collective"),
        ("IGNITE_EXT_SCHEDULER_CHANNEL", "store", "auto"),
        # Addresses: empty is unset; the store's is stripped, the relay's not.
        ("IGNITE_EXT_STORE_ADDR", "  ", None),
        ("IGNITE_EXT_STORE_ADDR", " 10.0.0.7 ", "10.0.0.7"),
        ("IGNITE_EXT_RELAY_ADDR", "", None),
        ("IGNITE_EXT_RELAY_PORTS", " 45000 ", range(45000, 45001)),
        ("IGNITE_EXT_RELAY_PORTS", "45000-", range(45000, 45001)),
        ("IGNITE_EXT_PERSIST_BYTES", "", None),
        ("IGNITE_EXT_PERSIST_BYTES", "0", 0),
        ("IGNITE_EXT_STORE_PORT", " 29500 ", 29500),
        ("IGNITE_EXT_PROGRESS_BOARD", "12:5", "12:5"),
    ],
)
def test_values_parse_as_they_did(name: str, text: str, value: object) -> None:
    assert settings.get(name, environ={name: text}) == value


@pytest.mark.parametrize(
    ("name", "text", "accepts"),
    [
        ("IGNITE_EXT_STORE_PORT", "eight", "a port number (0: any free port)"),
        ("IGNITE_EXT_STORE_PORT", "", "a port number (0: any free port)"),
        ("IGNITE_EXT_DOWNLOAD_BACKOFF_S", "fast", "a number of seconds"),
        ("IGNITE_EXT_PERSIST_BYTES", "10GB", "a whole number of bytes"),
        ("IGNITE_EXT_RELAY_PORTS", "45000-44000", "a port or a range 'first-last' of 1-65535"),
        ("IGNITE_EXT_RELAY_PORTS", "0", "a port or a range 'first-last' of 1-65535"),
        ("IGNITE_EXT_RELAY_PORTS", "http", "a port or a range 'first-last' of 1-65535"),
    ],
)
def test_a_bad_value_names_the_variable_its_value_and_what_it_accepts(name: str, text: str, accepts: str) -> None:
    with pytest.raises(ValueError) as raised:
        settings.get(name, environ={name: text})
    assert str(raised.value) == f"{name}={text!r}: expected {accepts}"


def test_the_read_sites_raise_the_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ignite_ext.data.cache.persist import persist_cap
    from ignite_ext.data.download._http import backoff_delay

    monkeypatch.setenv("IGNITE_EXT_DOWNLOAD_BACKOFF_S", "fast")
    with pytest.raises(ValueError, match=r"^IGNITE_EXT_DOWNLOAD_BACKOFF_S='fast': expected a number of seconds$"):
        backoff_delay(1)
    monkeypatch.setenv("IGNITE_EXT_PERSIST_BYTES", "10GB")
    with pytest.raises(ValueError, match=r"^IGNITE_EXT_PERSIST_BYTES='10GB': expected a whole number of bytes$"):
        persist_cap("/tmp")


def test_the_read_sites_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ignite_ext.data.cache.persist import persist_cap
    from ignite_ext.data.download._relaying import relay_host, relay_ports
    from ignite_ext.distributed import liveness
    from ignite_ext.distributed._waiting_line import LOG, waiting_line_role
    from ignite_ext.distributed.store.side import store_address
    from ignite_ext.distributed.store.watchdog import watchdog_enabled

    class Terminal:
        def isatty(self) -> bool:
            return True

    values = {
        "IGNITE_EXT_HEARTBEAT_TIMEOUT": "4",
        "IGNITE_EXT_WAIT_LOG_INTERVAL": "7",
        "IGNITE_EXT_STALL_TIMEOUT": "inf",
        "IGNITE_EXT_EARLY_HEARTBEAT": "0",
        "IGNITE_EXT_PROCESS_WATCH": "0",
        "IGNITE_EXT_STORE_WATCHDOG": "0",
        "IGNITE_EXT_WAITING_LINE": "no",
        "IGNITE_EXT_STORE_ADDR": "10.0.0.7",
        "IGNITE_EXT_RELAY_ADDR": "10.0.0.8",
        "IGNITE_EXT_RELAY_PORTS": "45000-45001",
        "IGNITE_EXT_PERSIST_BYTES": "1000",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    assert (liveness.heartbeat_timeout(), liveness.beat_interval(), liveness.log_interval()) == (4.0, 4 / 6, 7.0)
    assert liveness.stall_timeout() == math.inf
    assert not liveness.early_heartbeat() and not liveness.process_watch() and not watchdog_enabled()
    assert waiting_line_role(0, Terminal()) == LOG
    assert (store_address(), relay_host(), relay_ports()) == ("10.0.0.7", "10.0.0.8", range(45000, 45002))
    assert persist_cap("/tmp") == 1000


def test_an_unknown_name_says_so() -> None:
    with pytest.raises(KeyError, match="IGNITE_EXT_NO_SUCH is not a setting of ignite_ext"):
        settings.get("IGNITE_EXT_NO_SUCH")


def _table_extension() -> ModuleType:
    spec = importlib.util.spec_from_file_location("settings_table", ROOT / "docs" / "_ext" / "settings_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_tables_list_every_registered_variable() -> None:
    pytest.importorskip("sphinx")
    extension = _table_extension()
    page = (ROOT / "docs" / "settings.rst").read_text()
    assert re.findall(r"^\.\. settings-table:: (\w+)$", page, re.M) == [USER, INTERNAL]
    for audience in (USER, INTERNAL):
        text = "\n".join(extension.table_lines(audience))
        for name, setting in REGISTRY.items():
            assert text.count(f"``{name}``") == (setting.audience == audience), (audience, name)
    with pytest.raises(ValueError, match="no setting is for 'users'"):
        extension.table_lines("users")


def test_the_settings_page_builds_with_every_variable(tmp_path: Path) -> None:
    pytest.importorskip("sphinx")
    source = tmp_path / "source"
    source.mkdir()
    (source / "settings.rst").write_text((ROOT / "docs" / "settings.rst").read_text())
    (source / "conf.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'docs' / '_ext')!r})\n"
        'extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "settings_table"]\n'
        'root_doc = "settings"\n'
        'suppress_warnings = ["ref.term", "ref.doc"]  # the glossary is not built here; the docs build checks both\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(source), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "html" / "settings.html").read_text()
    for name in REGISTRY:
        assert f'<span class="pre">{name}</span>' in html, name
