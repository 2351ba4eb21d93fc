#!/usr/bin/env bash
# On a machine with a CUDA GPU: run every GPU test and the overlap measurement, then print a summary.
# Its timeouts keep it under 8 minutes on one GPU; tests that need two GPUs skip on one.
#
#   bash scripts/gpu_check.sh
#
# Uses $PYTHON if it has a CUDA build of torch, else .venv-gpu (made here: the pinned torch as this machine's pip
# resolves it - a CUDA build on a GPU machine - and this package with its test dependencies).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
has_cuda() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
PY="${PYTHON:-}"
if [ -z "$PY" ] || ! has_cuda "$PY"; then
  PY=.venv-gpu/bin/python
  if ! has_cuda "$PY"; then
    python3 -m venv .venv-gpu
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet "$(grep '^torch==' requirements/ci.txt)"
    "$PY" -m pip install --quiet -c requirements/ci.txt -e ".[dev]"
  fi
fi
if ! has_cuda "$PY"; then
  echo "gpu_check: no CUDA GPU visible to $PY; nothing to check" >&2
  exit 2
fi
"$PY" -c "import lightning_ddpopt" 2>/dev/null || "$PY" -m pip install --quiet --no-deps -e .
OUT="${GPU_CHECK_OUT:-gpu_check}"
mkdir -p "$OUT"
"$PY" - <<'PYEOF' | tee "$OUT/machine.txt"
import torch, lightning
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}")
for i in range(torch.cuda.device_count()):
    print(f"GPU {i}: {torch.cuda.get_device_name(i)}")
print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
PYEOF
timeout 360 "$PY" -m pytest -m gpu -v -p no:cacheprovider --timeout 120 -rA tests/test_gpu.py tests/test_gpu_ready.py \
  2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
{
  timeout 60 "$PY" benchmarks/gpu_overlap.py
  echo
  timeout 60 "$PY" benchmarks/gpu_overlap.py --peers 2
} 2>&1 | tee "$OUT/overlap.md"
echo
echo "== gpu_check summary =="
cat "$OUT/machine.txt"
grep -oE "^(PASSED|FAILED|SKIPPED|ERROR)" "$OUT/tests.log" | sort | uniq -c
grep -E "^(FAILED|ERROR)" "$OUT/tests.log"
tail -1 "$OUT/tests.log"
grep -E "^\| " "$OUT/overlap.md"
exit "$tests_rc"
