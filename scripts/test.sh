#!/usr/bin/env bash
# The whole test suite: sets up .venv, then lint, types, tests (with docstring examples) and the docs build.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
echo "[test] ruff";   ruff check ignite_ext tests benchmarks examples docs/conf.py setup.py
echo "[test] mypy";   mypy
echo "[test] pytest"; python -m pytest "$@"
echo "[test] docs";   python -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "[test] all checks passed"
