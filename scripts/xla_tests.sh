#!/usr/bin/env bash
# Opt-in: the XLA column of the backend matrix (not part of scripts/test.sh).
#
# Why a separate venv (.venv-xla, about 5.7 GB): torch_xla pins one exact torch release, and ignite 0.5.5 still
# calls xm.xrt_world_size / xm.get_ordinal, which torch_xla 2.9 removed. torch 2.6.0 + torch_xla 2.6.1 is the
# newest pair that works with ignite unpatched. PJRT_DEVICE=CPU runs XLA on the CPU, where only one device
# works, so the XLA world has one rank.
#
# The result summary is written between the "xla" markers of docs/backends_last_runs.md.
# Extra arguments go to pytest. Exit status: pytest's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV="${IGNITE_EXT_XLA_VENV:-$ROOT/.venv-xla}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
  echo "[xla] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.ignite_ext-xla-installed"
if [ ! -f "$STAMP" ]; then
  echo "[xla] installing torch 2.6.0 + torch_xla 2.6.1 (a large download), pytorch-ignite 0.5.5"
  # The machine-wide pip constraints may cap torch for the main venv; this venv pins its own exact versions.
  "$VENV/bin/pip" install -q "torch==2.6.0" "torch_xla==2.6.1" "pytorch-ignite==0.5.5" \
    filelock tqdm numpy pytest pytest-timeout
  # --no-deps: the project's own requirements name the main venv's torch; here torch is already pinned.
  "$VENV/bin/pip" install -q --no-deps "$ROOT"
  touch "$STAMP"
fi

export PJRT_DEVICE=CPU
LOG="$(mktemp "${TMPDIR:-/tmp}/xla_tests.XXXXXX.log")"
echo "[xla] running the XLA tests (log: $LOG)"
set +e
# tests/backends only, XLA column (plus serial, as a check that the venv itself is sane).
"$VENV/bin/python" -m pytest tests/backends -m "xla or not distributed" -rA -q "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e

# Record the outcome: when, which versions, the per-test lines and pytest's last line.
VERSIONS="$("$VENV/bin/python" -c 'import torch, torch_xla, ignite; print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, pytorch-ignite {ignite.__version__}")' 2>/dev/null || echo "versions unavailable")"
HEADLINE="Last run: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m), $(nproc) CPU cores, PJRT_DEVICE=CPU; $VERSIONS."
python3 "$ROOT/scripts/record_last_run.py" xla "XLA (\`bash scripts/xla_tests.sh\`)" "$HEADLINE" "$status" "$LOG" "$ROOT/docs/backends_last_runs.md"
echo "[xla] summary written to docs/backends_last_runs.md"
exit "$status"
