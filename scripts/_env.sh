# Sourced by demo.sh and test.sh: creates .venv (Python 3.11) and installs the project into it.
# torch goes in first and pinned, so that nothing later pulls a different (CUDA) build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV="${IGNITE_EXT_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
STAMP="$VENV/.ignite_ext-installed"
if [ ! -f "$STAMP" ] || [ setup.py -nt "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  echo "[setup] installing torch==2.13.0 (the CPU build, ~200 MB: a minute or two) ..."
  "$VENV/bin/pip" install -q "torch==2.13.0"
  echo "[setup] installing ignite_ext[${EXTRAS:-dev}] and its dependencies ..."
  "$VENV/bin/pip" install -q -e ".[${EXTRAS:-dev}]"
  touch "$STAMP"
  echo "[setup] done: $VENV"
fi
export PATH="$VENV/bin:$PATH"
