#!/usr/bin/env bash
# The whole test suite: sets up .venv, then lint, types, tests (with docstring examples) and the docs build.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# The fast lane (bash scripts/test.sh --lane=fast, see tests/_lanes.py): the tests that answer in minutes, without
# the environments only the full lane's tests use (Horovod, the peers), the 2.14.1 contract run and the docs build.
FAST=""
for arg in "$@"; do
  case "$arg" in --lane=fast) FAST=1 ;; esac
done
[ "${IGNITE_EXT_LANE:-}" = fast ] && FAST=1
if [ -n "$FAST" ]; then
  export IGNITE_EXT_NO_HOROVOD=1 IGNITE_EXT_NO_PEERS=1 IGNITE_EXT_NO_CACHE_PEERS=1 IGNITE_EXT_NO_COMPAT=1
fi
echo "[test] ruff";   ruff check ignite_ext tests benchmarks examples scripts docs/conf.py setup.py
ruff format --check ignite_ext tests benchmarks examples scripts docs/conf.py setup.py
echo "[test] mypy";   mypy
# optional_step NAME TAG SKIP_VAR FAILED_VAR LINES WHAT SCRIPT: runs SCRIPT, logged; shows its "[TAG]" lines or, if it
# fails, says so loudly (WHAT, then the log's last LINES lines) and exports FAILED_VAR, which the tests that need
# it skip on, naming it. A failure does not fail the suite. A non-empty SKIP_VAR in the environment leaves it out.
optional_step() {
  local name="$1" tag="$2" skip="$3" failed="$4" lines="$5" what="$6" script="$7"
  local log="${TMPDIR:-/tmp}/ignite_ext_${name}.log"
  echo "[test] $tag"
  if [ -n "$skip" ] && [ -n "${!skip:-}" ]; then
    echo "[test] $skip is set: leaving out $script"
  elif bash "$script" >"$log" 2>&1; then
    grep "^\[$tag\]" "$log" || true
  else
    echo "[test] !!! $what. Last lines of $log:"
    tail -n "$lines" "$log" | sed 's/^/[test] !!!   /'
    export "$failed=$script failed, see $log: $(tail -n 1 "$log")"
  fi
}
# Horovod for the backend matrix: installed from the wheel cache, or built once per torch version (minutes).
optional_step horovod_wheel horovod IGNITE_EXT_NO_HOROVOD IGNITE_EXT_HOROVOD_BUILD_FAILED 15 \
  "HOROVOD BUILD FAILED: the Horovod tests will be skipped" scripts/horovod_wheel.sh
# The download peers (torchvision, pooch) in an environment of their own: created once (~90 s), then cached.
optional_step peers_env peers IGNITE_EXT_NO_PEERS IGNITE_EXT_PEERS_FAILED 5 \
  "PEERS ENVIRONMENT FAILED: the torchvision stand-in test will be skipped" scripts/peers_env.sh
# The cache peers (LitData, Mosaic streaming) in an environment of their own: created once (a few minutes), then
# cached.
optional_step cache_peers_env cache-peers IGNITE_EXT_NO_CACHE_PEERS IGNITE_EXT_CACHE_PEERS_FAILED 5 \
  "CACHE PEERS ENVIRONMENT FAILED: the cache-peers benchmark test will be skipped" scripts/cache_peers_env.sh
# Simulated hosts for tests/hosts (network, UTS, mount and PID namespaces; needs root): probed here, after sweeping
# what crashed runs left. Where they cannot be made the suite does not fail: it says so loudly, and the multi-host
# tests skip with the reason.
echo "[test] hosts"
if HOSTS_PROBE="$(python -m tests._hosts 2>&1)"; then
  echo "[test] $HOSTS_PROBE"
else
  echo "[test] !!! SIMULATED HOSTS UNAVAILABLE: the multi-host tests (tests/hosts) will be skipped: $HOSTS_PROBE"
  export IGNITE_EXT_HOSTS_UNAVAILABLE="${HOSTS_PROBE:-the probe (python -m tests._hosts) failed without a word}"
fi
# A Slurm node for tests/slurm (slurm-wlm and munge, as root): probed here; where it cannot start, the suite says so
# loudly and the Slurm tests skip with the reason.
echo "[test] slurm"
if SLURM_PROBE="$(python -m tests._slurm 2>&1)"; then
  echo "[test] $SLURM_PROBE"
else
  echo "[test] !!! SLURM UNAVAILABLE: the Slurm tests (tests/slurm) will be skipped: $SLURM_PROBE"
  export IGNITE_EXT_SLURM_UNAVAILABLE="${SLURM_PROBE:-the probe (python -m tests._slurm) failed without a word}"
fi
echo "[test] pytest"; python -m pytest "$@"
# The tests with DataLoader workers again, on a second interpreter without CPython's fork deadlock (Python 3.12, in
# an environment of its own with PyPI's torch 2.13.0): in the background, beside the contract run and the docs
# build, which leave a core to it. A red lane is a red suite; a machine without Python 3.12 says so loudly and
# leaves it out. IGNITE_EXT_NO_SECOND_PYTHON=1 leaves it out; SECOND_PYTHON=3.13 picks another.
SECOND="" SECOND_LOG="${TMPDIR:-/tmp}/ignite_ext_second_python.log"
if [ -z "$FAST" ] && [ -z "${IGNITE_EXT_NO_SECOND_PYTHON:-}" ]; then
  echo "[test] second interpreter: the fork lane on Python ${SECOND_PYTHON:-3.12}, in the background"
  setsid bash scripts/compat.sh --fork "2.13.0:0.5.5:${SECOND_PYTHON:-3.12}" >"$SECOND_LOG" 2>&1 &
  SECOND=$!
  # A step below that fails ends this script: the lane (its own process group) goes with it.
  trap 'kill -KILL -- "-$SECOND" 2>/dev/null || true' EXIT
fi
# The store contract on the other torch this machine has on disk (2.14.1; the suite above ran 2.13.0): a red
# contract is a red suite. IGNITE_EXT_NO_COMPAT=1 leaves it out (a machine without that build).
echo "[test] compat"
if [ -z "${IGNITE_EXT_NO_COMPAT:-}" ]; then
  bash scripts/compat.sh --contract "2.14.1:0.5.5" | grep '^\[compat\]'
fi
if [ -n "$FAST" ]; then
  echo "[test] fast lane: docs build left for the full lane"
else
  echo "[test] docs";   python -m sphinx -W --keep-going -q -b html docs docs/_build/html
fi
if [ -n "$SECOND" ]; then
  echo "[test] second interpreter"
  if wait "$SECOND"; then
    grep '^\[compat\] |' "$SECOND_LOG"
  elif grep -q '^\[compat\] no Python' "$SECOND_LOG"; then
    echo "[test] !!! NO SECOND INTERPRETER: the fork lane ran on one Python only: $(grep '^\[compat\] no' "$SECOND_LOG")"
  else
    echo "[test] !!! the fork lane on a second interpreter FAILED; last lines of $SECOND_LOG:"
    tail -n 40 "$SECOND_LOG" | sed 's/^/[test] !!!   /'
    exit 1
  fi
fi
echo "[test] all checks passed"
