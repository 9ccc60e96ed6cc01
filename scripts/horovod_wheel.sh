#!/usr/bin/env bash
# Builds (once) and installs horovod 0.28.1 with its Gloo controller into the active venv.
#
# Why a build: horovod ships no wheels, and its 0.28.1 sdist sets CMAKE_CXX_STANDARD 14, which torch >= 2.1
# headers no longer compile under. We raise it to 17 in the two CMakeLists that set it and build against the
# installed (CPU) torch without MPI, TensorFlow or MXNet.
#
# Why a cache: the build takes minutes on a small machine. The wheel is kept outside the repository, keyed by
# the horovod version, the torch version and the Python tag, so a warm run only installs it.
#
# Usage: bash scripts/horovod_wheel.sh   (uses $PYTHON or the python on PATH, i.e. the active venv)
# Exit status: 0 when horovod.torch imports afterwards, non-zero otherwise (the caller decides what to do).
set -euo pipefail
# The last line of a failed run names the step that failed (scripts/test.sh shows it as the skip reason).
trap 'echo "[horovod] FAILED (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR

HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
PY="${PYTHON:-python}"
# An absolute interpreter path: the build below runs from inside the unpacked sdist.
PY="$("$PY" -c 'import sys; print(sys.executable)')"
CACHE="${IGNITE_EXT_CACHE:-$HOME/.cache/ignite_ext}"

# The key: a wheel built against one torch does not load with another (C++ ABI of the extension).
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
PY_TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION//+/_}_${PY_TAG}"
WHEEL_DIR="$CACHE/wheels/$KEY"
mkdir -p "$WHEEL_DIR"

already_installed() {
  # horovod.torch loads the compiled extension: importing only `horovod` would not prove the build works.
  "$PY" - "$HOROVOD_VERSION" <<'EOF' 2>/dev/null
import sys
import horovod
import horovod.torch  # noqa: F401
sys.exit(0 if horovod.__version__ == sys.argv[1] else 1)
EOF
}

if already_installed; then
  echo "[horovod] horovod $HOROVOD_VERSION already installed for torch $TORCH_VERSION"
  exit 0
fi

shopt -s nullglob
wheels=("$WHEEL_DIR"/horovod-*.whl)
if [ "${#wheels[@]}" -eq 0 ]; then
  START=$(date +%s)
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
  echo "[horovod] no cached wheel in $WHEEL_DIR: building horovod $HOROVOD_VERSION against torch $TORCH_VERSION"
  for tool in cmake g++; do
    command -v "$tool" >/dev/null || { echo "[horovod] $tool not found: cannot build" >&2; exit 2; }
  done
  # The sdist only (there is no binary to pick anyway; --no-binary keeps pip from trying to build it here).
  "$PY" -m pip download -q --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" -d "$WORK"
  tar -xzf "$WORK"/horovod-"$HOROVOD_VERSION".tar.gz -C "$WORK"
  SRC="$WORK/horovod-$HOROVOD_VERSION"
  # torch >= 2.1 needs C++17; fail loudly if the line to change is not where we expect it.
  for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    grep -q 'CMAKE_CXX_STANDARD 14' "$f" || { echo "[horovod] no 'CMAKE_CXX_STANDARD 14' in $f" >&2; exit 3; }
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$f"
  done
  # cloudpickle, psutil, pyyaml, packaging are horovod's runtime needs (horovodrun and the torch module).
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging
  # --no-build-isolation: compile against the torch of this venv, not a freshly downloaded one.
  (
    cd "$SRC"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS="${MAKEFLAGS:--j2}" \
      "$PY" -m pip wheel --no-build-isolation --no-deps . -w "$WORK/dist"
  )
  # Publish into the cache atomically: a half-copied wheel must never look like a cached one.
  built=("$WORK"/dist/horovod-*.whl)
  cp "${built[0]}" "$WHEEL_DIR/.partial"
  mv "$WHEEL_DIR/.partial" "$WHEEL_DIR/$(basename "${built[0]}")"
  wheels=("$WHEEL_DIR/$(basename "${built[0]}")")
  echo "[horovod] built $(basename "${built[0]}") in $(( $(date +%s) - START )) s, cached in $WHEEL_DIR"
else
  echo "[horovod] using cached ${wheels[0]}"
fi

"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
"$PY" -m pip install -q --no-deps --force-reinstall "${wheels[0]}"
already_installed || { echo "[horovod] installed wheel does not import horovod.torch" >&2; exit 4; }
echo "[horovod] horovod $HOROVOD_VERSION installed"
