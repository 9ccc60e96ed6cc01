"""The scripts that build environments (``scripts/*_env.sh``, ``scripts/compat.sh``) hand pip whole requirements,
and an environment an earlier run left cannot stand in for a recipe that changed.

A fresh machine runs every recipe from scratch; a machine that kept ``~/.cache/ignite_ext`` does not, which once
hid a recipe that split ``'filelock>=3.20.3; sys_platform == "win32"'`` into ``==`` and other words. So the recipes
take setup.py's requirements from one helper, and each environment is keyed by a digest of its recipe. And the
project's own environment's interpreter is what ``scripts/_python.sh`` picks, run here with stand-in interpreters.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


# A stand-in interpreter for scripts/_python.sh: says its version, and which torch its pip would install (the
# report's reader is handed to the real Python).
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then
  case "$2" in
    *version_info*) echo "{version}"; exit 0 ;;
    *) exec {real} "$@" ;;
  esac
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo '{{"install": [{{"metadata": {{"name": "torch", "version": "{torch}"}}}}]}}'
  exit 0
fi
exit 1
"""


def _fake(path: Path, version: str, torch: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_PYTHON.format(version=version, real=sys.executable, torch=torch))
    path.chmod(0o755)


def _pick(tmp_path: Path, pythons: dict[str, tuple[str, str]], python: str = "") -> tuple[str, str]:
    """What scripts/_python.sh picks with ``pythons`` (name on PATH or pyenv version: (version, torch))."""
    bin_dir, pyenv = tmp_path / "bin", tmp_path / "pyenv"
    for name, (version, torch) in pythons.items():
        _fake(bin_dir / name if name.startswith("python") else pyenv / "versions" / name / "bin" / "python3",
              version, torch)  # fmt: skip
    env = {"PATH": str(bin_dir), "PYENV_ROOT": str(pyenv), "HOME": str(tmp_path), "PYTHON": python}
    script = f'VENV={tmp_path}/venv; source {SCRIPTS / "_python.sh"}; echo "PY=$PY $PY_VERSION"'
    done = subprocess.run(["/bin/bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1], done.stdout + done.stderr


def test_the_setup_picks_a_python_without_the_fork_deadlock_where_the_cpu_torch_is_at_hand(tmp_path: Path) -> None:
    pythons = {
        "3.13.1": ("3.13.1", "2.13.0"),
        "3.12.9": ("3.12.9", "2.13.0+cpu"),
        "python3.11": ("3.11.7", "2.13.0+cpu"),
    }
    picked, said = _pick(tmp_path, pythons)
    assert picked == f"PY={tmp_path}/pyenv/versions/3.12.9/bin/python3 3.12.9", said
    assert "picked Python 3.12.9" in said and "WARNING" not in said


def test_without_a_cpu_torch_for_the_fixed_pythons_the_setup_stays_on_3_11_and_warns(tmp_path: Path) -> None:
    # PyPI's build for 3.12 and 3.13 is a CUDA build of 5 GB: the setup says so and keeps to the CPU build.
    pythons = {"3.13.1": ("3.13.1", "2.13.0"), "3.12.9": ("3.12.9", "2.13.0"), "python3.11": ("3.11.7", "2.13.0+cpu")}
    picked, said = _pick(tmp_path, pythons)
    assert picked == "PY=python3.11 3.11.7", said
    assert "Python 3.13.1 3.12.9 here, without the fork deadlock" in said and "gh-112275" in said


def test_a_fixed_3_11_or_the_users_choice_is_taken_as_it_is(tmp_path: Path) -> None:
    picked, said = _pick(tmp_path, {"python3.11": ("3.11.12", "2.13.0+cpu")})
    assert picked == f"PY={tmp_path}/bin/python3.11 3.11.12" and "WARNING" not in said, said
    picked, said = _pick(tmp_path, {"python3.11": ("3.11.12", "2.13.0+cpu")}, python="python3.11")
    assert picked == "PY=python3.11 3.11.12", said
