#!/usr/bin/env bash
# Creates (once) the virtual environment of the download peers: torchvision and pooch, with the torch that
# torchvision needs (PyPI's torchvision does not load beside the CPU build of torch 2.13.0 the project uses, so
# the peers get torch 2.14.1 + torchvision 0.29.1 of their own). Used by the parallel-ranges benchmark and by the
# test that runs torchvision's download_and_extract_archive with ignite_ext's download_url patched in.
#
# The venv is kept outside the repository (about 5.5 GB, ~90 s to create here), keyed by the versions and the recipe.
# Usage: bash scripts/peers_env.sh    prints the venv's python on its last line
# Exit status: 0 when torchvision and pooch import in it, non-zero otherwise (the caller decides what to do).
set -euo pipefail
trap 'echo "[peers] FAILED (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

TORCH="${PEERS_TORCH:-2.14.1}"
TORCHVISION="${PEERS_TORCHVISION:-0.29.1}"
POOCH="${PEERS_POOCH:-1.9.0}"
CACHE="${IGNITE_EXT_CACHE:-$HOME/.cache/ignite_ext}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

make_env() {
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH" "torchvision==$TORCHVISION" "pooch==$POOCH" >&2
}
# Keyed by the versions and by how it is made: a changed recipe makes a new environment, never reuses an old one.
PREFIX="$CACHE/venvs/peers_torch-${TORCH}_torchvision-${TORCHVISION}_pooch-${POOCH}"
VENV="${PREFIX}_$( (declare -f make_env; echo "$PY") | sha256sum | cut -c1-10)"

ready() {
  "$VENV/bin/python" -c "import torchvision.datasets.utils, pooch" 2>/dev/null
}

if ! ready; then
  echo "[peers] creating $VENV (torch $TORCH, torchvision $TORCHVISION, pooch $POOCH)" >&2
  rm -rf "$PREFIX" "$PREFIX"_*  # the environments of earlier recipes (5.5 GB each)
  make_env
  ready
fi
echo "[peers] ready: $VENV" >&2
echo "$VENV/bin/python"
