# Sourced by demo.sh and test.sh: creates .venv and installs the project into it.
# torch goes in first and pinned, so that nothing later pulls a different (CUDA) build.
#
# The interpreter is scripts/_python.sh's choice; a .venv made with another one is made anew.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${IGNITE_EXT_VENV:-$ROOT/.venv}"
source "$ROOT/scripts/_python.sh"
if [ -x "$VENV/bin/python" ] && [ "$(_version_of "$VENV/bin/python")" != "$PY_VERSION" ]; then
  echo "[setup] $VENV has Python $(_version_of "$VENV/bin/python"), not $PY_VERSION: making it anew"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with Python $PY_VERSION ($(command -v "$PY"))"
  "$PY" -m venv "$VENV"
fi
echo "[setup] Python $PY_VERSION, $VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
STAMP="$VENV/.ignite_ext-installed"
if [ ! -f "$STAMP" ] || [ setup.py -nt "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "[setup] installing torch==2.13.0 (the CPU build where it is on disk, ~200 MB: a minute or two) ..."
  "$VENV/bin/pip" install -q "torch==2.13.0"
  echo "[setup] installing ignite_ext[${EXTRAS:-dev}] and its dependencies ..."
  "$VENV/bin/pip" install -q -e ".[${EXTRAS:-dev}]"
  touch "$STAMP"
  echo "[setup] done: $VENV"
fi
export PATH="$VENV/bin:$PATH"
