"""The scripts that build environments (``scripts/*_env.sh``, ``scripts/compat.sh``) hand pip whole requirements,
and an environment an earlier run left cannot stand in for a recipe that changed.

A fresh machine runs every recipe from scratch; a machine that kept ``~/.cache/ignite_ext`` does not, which once
hid a recipe that split ``'filelock>=3.20.3; sys_platform == "win32"'`` into ``==`` and other words. So the recipes
take setup.py's requirements from one helper, and each environment is keyed by a digest of its recipe.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
ENV_SCRIPTS = [SCRIPTS / "cache_peers_env.sh", SCRIPTS / "peers_env.sh", SCRIPTS / "compat.sh"]


def _setup_list(name: str) -> list[str]:
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == name:
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"setup.py has no {name}")


def _as_bash_array(*args: str) -> list[str]:
    """What ``own_requirements`` puts in a script's array, element by element (NUL-separated on the way out)."""
    script = f'source {SCRIPTS / "_requirements.sh"}; own_requirements DEPS "$@"; printf "%s\\0" "${{DEPS[@]}}"'
    done = subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, timeout=60, check=True)
    return done.stdout.decode().split("\0")[:-1]


def test_a_requirement_with_a_marker_reaches_pip_as_one_argument() -> None:
    wanted = _setup_list("install_requires")
    assert any(" " in r for r in wanted), "setup.py has no requirement with spaces left: the test checks nothing"
    got = _as_bash_array()
    assert got == wanted
    assert all(str(Requirement(r)) for r in got)  # each parses: no "==" or "sys_platform" alone


def test_extras_and_pinned_distributions_as_the_version_fence_asks() -> None:
    got = _as_bash_array("--extra", "test", "--without", "torch", "--without", "pytorch-ignite")
    names = [Requirement(r).name for r in got]
    assert "torch" not in names and "pytorch-ignite" not in names
    assert {"pytest", "hypothesis", "tqdm", "numpy", "filelock"} <= set(names)
    assert [r for r in got if Requirement(r).name == "filelock"] == [
        r for r in _setup_list("install_requires") if r.startswith("filelock")
    ]


@pytest.mark.parametrize("script", ENV_SCRIPTS, ids=lambda p: p.name)
def test_every_recipe_keys_its_environment_by_itself_and_reads_setup_py_through_the_helper(script: Path) -> None:
    text = script.read_text(encoding="utf-8")
    assert "install_requires" not in text and 'setup.py"' not in text.replace("from its setup.py", "")
    assert "make_env()" in text and "declare -f make_env" in text and "sha256sum" in text
    assert 'rm -rf "$PREFIX" "$PREFIX"_*' in text or 'rm -rf "$prefix" "$prefix"_*' in text


def test_the_cache_peers_environment_of_another_recipe_is_not_taken_for_ready(tmp_path: Path) -> None:
    # An environment that an earlier recipe left (marked complete, importing nothing of this recipe) under the
    # versions' name: --check must say missing, not ready.
    stale = tmp_path / "venvs" / "cache_peers_torch-2.13.0_litdata-0.2.76_streaming-0.13.0"
    (stale / "bin").mkdir(parents=True)
    (stale / ".complete").touch()
    done = subprocess.run(
        ["bash", str(SCRIPTS / "cache_peers_env.sh"), "--check"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "IGNITE_EXT_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert "missing:" in done.stderr and f"{stale}_" in done.stderr
