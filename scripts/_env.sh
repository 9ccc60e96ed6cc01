# Sourced by demo.sh and test.sh: creates .venv and installs the project into it.
# torch goes in first and pinned, so that nothing later pulls a different (CUDA) build.
#
# The interpreter: $PYTHON if set, else python3.11, the Python that the CPU build of torch 2.13.0 lies on disk for
# here (for another Python, pip takes PyPI's CUDA build: 5.0 GB of venv instead of 1.3 GB). It is named, and an
# interpreter with CPython's fork deadlock (gh-112275: 3.11.0-3.11.9, where a DataLoader worker forked by a rank can
# hang) is warned about. A .venv made with another interpreter than this one is made anew.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
_version_of() { "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null; }
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
PY_VERSION="$(_version_of "$PY")"
case "$PY_VERSION" in
  3.11.[0-9])
    echo "[setup] WARNING: Python $PY_VERSION has CPython's fork deadlock (gh-112275, fixed in 3.11.10): a" \
      "DataLoader worker forked by a rank can hang before it starts. PYTHON=python3.12 (or 3.13, 3.11.10+)" \
      "picks another interpreter (with PyPI's CUDA build of torch where no CPU build is at hand)" >&2 ;;
esac
VENV="${IGNITE_EXT_VENV:-$ROOT/.venv}"
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
