# Sourced by _env.sh (after it sets VENV): the interpreter of the project's environment, in PY and PY_VERSION.
#
# $PYTHON if set; else the environment's own, once made; else the first admitted Python here without CPython's
# fork deadlock (gh-112275: 3.11.0-3.11.9, where a DataLoader worker forked by a rank can hang), newest first, for
# which pip finds the CPU build of torch 2.13.0 (PyPI's is a CUDA build: 5.0 GB of venv instead of 1.3 GB): a dry
# run of pip per candidate, only when the environment is made; else python3.11, with a warning when it has the
# deadlock. The choice is said, and why.
_version_of() { "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null; }
_affected() { case "$1" in 3.11.[0-9]) return 0 ;; *) return 1 ;; esac; }
# Whether pip, run by interpreter $1, would install a CPU build of torch 2.13.0 (a dry run: it reads the indexes).
_cpu_torch_for() {
  "$1" -m pip install --dry-run --no-deps --quiet --ignore-installed --report - "torch==2.13.0" 2>/dev/null |
    "$1" -c 'import json, sys; r = json.load(sys.stdin)
sys.exit(0 if any(i["metadata"]["version"].endswith("+cpu") for i in r["install"]) else 1)' 2>/dev/null
}
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$VENV/bin/python" ] && [ -f "$VENV/.ignite_ext-installed" ]; then
  PY="$VENV/bin/python"
else
  PY="" skipped=""
  for minor in 3.13 3.12 3.11; do
    for c in "python$minor" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$minor".*/bin/python3; do
      version="$(_version_of "$c")" || continue
      if _affected "$version" || [[ " $skipped " == *" $version "* ]]; then continue; fi
      if _cpu_torch_for "$c"; then PY="$(command -v "$c")"; break 2; fi
      skipped="$skipped $version"
    done
  done
  if [ -n "$PY" ]; then
    echo "[setup] picked Python $(_version_of "$PY"): no fork deadlock, and the CPU build of torch 2.13.0 at hand"
  else
    PY=python3.11
    command -v "$PY" >/dev/null || PY=python3
    [ -z "$skipped" ] || echo "[setup] Python${skipped} here, without the fork deadlock, but pip finds only PyPI's" \
      "CUDA build of torch 2.13.0 for them (5 GB): PYTHON=<interpreter> picks one anyway"
  fi
fi
PY_VERSION="$(_version_of "$PY")"
if _affected "$PY_VERSION"; then
  echo "[setup] WARNING: Python $PY_VERSION has CPython's fork deadlock (gh-112275, fixed in 3.11.10): a" \
    "DataLoader worker forked by a rank can hang before it starts. PYTHON=python3.12 (or 3.13, 3.11.10+)" \
    "picks another interpreter (with PyPI's CUDA build of torch where no CPU build is at hand)" >&2
fi
