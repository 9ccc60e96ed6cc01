#!/usr/bin/env bash
# Creates (once) the virtual environment of the cache peers: LitData and Mosaic streaming, installed from PyPI as
# a user would, beside the CPU build of torch the project uses (installed first and pinned, so that no dependency
# pulls a CUDA build), ignite_ext's own dependencies, and psutil. Both peers pull torchvision, whose PyPI build is
# made for the CUDA build of torch and cannot load beside the CPU one ("operator torchvision::nms does not
# exist"), so it is removed again: LitData does without it, and Mosaic needs it only for its vision datasets,
# which the benchmark does not import (see benchmarks/_cache_peers.py). The cache-peers benchmark runs every variant
# (in-memory, CachedDataset, LitData, Mosaic) in this one interpreter, with the working tree on PYTHONPATH, so that
# they share the same torch, numpy and Python.
#
# The venv is kept outside the repository (~/.cache/ignite_ext/venvs, about 1.5 GB, a few minutes to create here),
# keyed by the versions and the recipe; nothing is downloaded once it exists.
# Usage: bash scripts/cache_peers_env.sh [--check]    prints the venv's python on its last line
#   --check: only say whether it is there; never create it (what the tests use: they install nothing).
# Exit status: 0 when litdata and streaming import in it, non-zero otherwise (the caller decides what to do).
set -euo pipefail
trap 'echo "[cache-peers] FAILED (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_requirements.sh"
TORCH="${CACHE_PEERS_TORCH:-2.13.0}"
LITDATA="${CACHE_PEERS_LITDATA:-0.2.76}"
STREAMING="${CACHE_PEERS_STREAMING:-0.13.0}"
CACHE="${IGNITE_EXT_CACHE:-$HOME/.cache/ignite_ext}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The dependencies of ignite_ext from its setup.py (the package itself comes from the working tree at run time).
own_requirements OWN_DEPS

make_env() {
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH" >&2
  "$VENV/bin/pip" install -q "torch==$TORCH" "litdata==$LITDATA" "mosaicml-streaming==$STREAMING" psutil \
    "${OWN_DEPS[@]}" >&2
  "$VENV/bin/pip" uninstall -q -y torchvision >&2
}

# Keyed by the versions and by how it is made (this function and the requirements): a change to either makes a new
# environment, so an environment an earlier run left can never hide a broken recipe.
KEY="$( (declare -f make_env; printf '%s\n' "$PY" "${OWN_DEPS[@]}") | sha256sum | cut -c1-10)"
PREFIX="$CACHE/venvs/cache_peers_torch-${TORCH}_litdata-${LITDATA}_streaming-${STREAMING}"
VENV="${PREFIX}_${KEY}"

ready() {
  [ -f "$VENV/.complete" ] && PYTHONPATH="$ROOT" "$VENV/bin/python" -c \
    "import litdata, ignite.distributed, psutil; from benchmarks._cache_peers import import_streaming; import_streaming()"
}

if ! ready && [ "${1:-}" = "--check" ]; then
  echo "[cache-peers] missing: $VENV (bash scripts/cache_peers_env.sh creates it)" >&2
  exit 3
fi
if ! ready; then
  echo "[cache-peers] creating $VENV (torch $TORCH CPU, litdata $LITDATA, mosaicml-streaming $STREAMING)" >&2
  rm -rf "$PREFIX" "$PREFIX"_*  # the environments of earlier recipes (1.5 GB each)
  make_env
  touch "$VENV/.complete"
  ready
fi
echo "[cache-peers] ready: $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("litdata", "mosaicml-streaming", "torch")))'))" >&2
echo "$VENV/bin/python"
