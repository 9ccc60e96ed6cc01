#!/usr/bin/env bash
# The NCCL column of the backend matrix, as one prepared check for a GPU machine (meant to finish in < 5 min).
#
# Why a venv with --system-site-packages: a GPU machine normally has a CUDA torch already; downloading another
# (several GB) would eat most of the time budget. Only when no CUDA torch is importable is one installed.
# The NCCL world has one rank per GPU, up to 4; with one GPU it is a world of one, which still initialises a
# real NCCL communicator and runs every body's collectives and barriers (with device ids) on the GPU.
#
# The result summary is written between the "nccl" markers of docs/backends_last_runs.md.
# Extra arguments go to pytest. Exit status: pytest's (2 when there is no GPU at all).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$(date +%s)
PY="${PYTHON:-python3}"
VENV="${IGNITE_EXT_NCCL_VENV:-$ROOT/.venv-nccl}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[nccl] no NVIDIA GPU visible (nvidia-smi -L fails): nothing to check" >&2
  exit 2
fi
nvidia-smi -L

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
has_cuda_torch() {
  "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.distributed.is_nccl_available() else 1)' 2>/dev/null
}
if ! has_cuda_torch; then
  echo "[nccl] no CUDA torch importable: installing torch from PyPI (a CUDA build; large download)"
  "$VENV/bin/pip" install -q torch
fi
# The rest is small; --no-deps for the project so that nothing replaces the machine's torch.
"$VENV/bin/pip" install -q "pytorch-ignite==0.5.5" filelock tqdm numpy pytest pytest-timeout
"$VENV/bin/pip" install -q --no-deps "$ROOT"
"$VENV/bin/python" -c 'import torch; print(f"[nccl] torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), NCCL {torch.cuda.nccl.version()}")'

LOG="$(mktemp "${TMPDIR:-/tmp}/nccl_check.XXXXXX.log")"
set +e
# 240 s hard cap on the tests themselves; each world also has its own 60 s deadline inside the tests.
timeout -k 10 240 "$VENV/bin/python" -m pytest tests/backends -m nccl -rA -q "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e

HEADLINE="Last run: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi -L | wc -l) GPU(s) ($(nvidia-smi --query-gpu=name --format=csv,noheader | sort -u | paste -sd, -)), $(( $(date +%s) - START )) s in all."
"$VENV/bin/python" "$ROOT/scripts/record_last_run.py" nccl "NCCL (\`bash scripts/nccl_check.sh\`)" "$HEADLINE" "$status" "$LOG" "$ROOT/docs/backends_last_runs.md"
echo "[nccl] summary written to docs/backends_last_runs.md"
exit "$status"
