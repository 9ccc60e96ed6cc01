#!/usr/bin/env bash
# The version fence: one environment per (torch, pytorch-ignite, Python), and in each the tests that rest on what
# torch does not promise (the store contract, process watching, liveness), the cache's and the sampler's tests (the
# ranks' forks of DataLoader workers), a seeded sample of the fault sweep, the backend matrix and the examples.
# Prints one table row per environment for the "Versions" table of docs/backends.rst.
#
# Usage: bash scripts/compat.sh [TORCH:IGNITE[:PYTHON] ...]   default: the pairs below (oldest and newest admitted,
#        bash scripts/compat.sh --contract TORCH:IGNITE[:PYTHON]  the releases between where torch's store changed)
#        bash scripts/compat.sh --fork TORCH:IGNITE[:PYTHON]      the tests with DataLoader workers only
#   PYTHON: a minor version (3.12), found as python3.12 or in pyenv's versions; by default $PYTHON or python3.11.
#   --contract: the store-contract tests only (what CI runs on the builds this machine has on disk).
#   --fork: the cache's and the sampler's tests with workers (what CI runs on a second interpreter).
# PyPI's torch wheels other than the CPU build on disk are CUDA builds of a few GB: they install and run on the CPU.
# The environments are kept outside the repository ($IGNITE_EXT_CACHE/venvs/compat_*), keyed by the versions.
# Exit status: 0 when every pair passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${IGNITE_EXT_CACHE:-$HOME/.cache/ignite_ext}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1

SCOPE=full
case "${1:-}" in
  --contract) SCOPE=contract; shift ;;
  --fork) SCOPE=fork; shift ;;
esac
# 2.1.2: the floor (no Store.clone, no check, no DistStoreError, the store protocol without VALIDATE);
# 2.5.1: libuv store by default, still no Store.clone; 2.13.0: the CPU build this project runs on; 2.14.1: newest.
PAIRS=("$@")
[ ${#PAIRS[@]} -gt 0 ] || PAIRS=("2.1.2:0.5.1" "2.5.1:0.5.1" "2.13.0:0.5.5" "2.14.1:0.5.5")

CONTRACT=(tests/distributed/test_store_contract.py tests/distributed/test_process_watch.py
  ignite_ext/distributed/store)
# The tests whose ranks fork DataLoader workers (or start them otherwise): what an interpreter's fork changes.
FORK=(tests/data/test_fork_safety.py tests/data/test_cache.py tests/data/test_cache_world.py tests/data/test_cache_dist.py
  tests/data/test_cache_restart.py tests/data/test_cache_sigterm.py tests/data/test_sampler_distributed.py
  tests/data/test_sampler_resume_distributed.py)
FULL=("${CONTRACT[@]}" "${FORK[@]}" tests/data/test_start_methods.py tests/distributed/test_liveness.py tests/distributed/test_fault_sweep.py
  tests/backends/test_matrix.py tests/test_examples.py tests/data/test_cache_follow.py tests/data/test_sampler.py
  tests/distributed/test_incarnation.py tests/distributed/test_torchrun_restart.py)

# The interpreter of a minor version: python3.X where it runs, else pyenv's.
interpreter() {
  local c
  for c in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python3; do
    "$c" -c 'import sys' 2>/dev/null && { command -v "$c"; return 0; }
  done
  echo "[compat] no Python $1 here" >&2
  return 1
}

source "$ROOT/scripts/_requirements.sh"
# The package's own requirements and its test extra, whole (torch and pytorch-ignite are pinned per pair).
own_requirements OWN_DEPS --extra test --without torch --without pytorch-ignite

make_env() {  # make_env VENV TORCH IGNITE PYTHON
  local venv="$1" torch_v="$2" ignite_v="$3" python="$4" numpy="numpy>=1.26"
  # torch before 2.3 was built against numpy 1.x
  case "$torch_v" in 2.1.*|2.2.*) numpy="numpy>=1.26,<2" ;; esac
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$torch_v" "pytorch-ignite==$ignite_v" "$numpy" >&2
  "$venv/bin/pip" install -q --no-deps -e . >&2
  "$venv/bin/pip" install -q "$numpy" "${OWN_DEPS[@]}" >&2
}
# Keyed by the versions and by how it is made (make_env and the requirements): a change to either makes a new
# environment, so an environment an earlier run left can never hide a broken recipe.
RECIPE="$( (declare -f make_env; printf '%s\n' "${OWN_DEPS[@]}") | sha256sum | cut -c1-10)"

status=0
for pair in "${PAIRS[@]}"; do
  IFS=: read -r torch_v ignite_v py_minor <<<"$pair"
  python="$PY"
  [ -z "$py_minor" ] || python="$(interpreter "$py_minor")"
  py_v="$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
  prefix="$CACHE/venvs/compat_torch-${torch_v}_ignite-${ignite_v}_py-${py_v}"
  venv="${prefix}_${RECIPE}"
  if [ ! -f "$venv/.ready" ]; then
    echo "[compat] creating $venv" >&2
    rm -rf "$prefix" "$prefix"_*  # the environments of earlier recipes (a few GB each)
    make_env "$venv" "$torch_v" "$ignite_v" "$python"
    touch "$venv/.ready"
  fi
  selection=("${CONTRACT[@]}")
  [ "$SCOPE" = full ] && selection=("${FULL[@]}")
  [ "$SCOPE" = fork ] && selection=("${FORK[@]}")
  log="${TMPDIR:-/tmp}/ignite_ext_compat_${torch_v}_${ignite_v}_${py_v}.log"
  echo "[compat] torch $torch_v, pytorch-ignite $ignite_v, Python $py_v: ${selection[*]}" >&2
  if (cd "$ROOT" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "${selection[@]}") >"$log" 2>&1; then
    verdict=green
  else
    verdict=red; status=1
  fi
  summary="$(grep -E '^=+ .*(passed|failed).* =+$|^[0-9]+ (passed|failed)' "$log" | tail -n 1 | tr -d '=' | xargs)"
  versions="$("$venv/bin/python" -c 'import torch, ignite; print(torch.__version__, ignite.__version__)' 2>/dev/null)"
  echo "[compat] | $(date -u +%F) | $(git rev-parse --short HEAD) | ${versions% *} | ${versions#* } | $py_v | $SCOPE | $verdict: $summary |"
  [ "$verdict" = green ] || tail -n 30 "$log" | sed 's/^/[compat] !!! /' >&2
done
exit $status
