#!/usr/bin/env bash
# One short prepared run for a lent GPU machine (at most 10 minutes; every part has its own timeout).
# Needs: PY = a python with CUDA torch and this project installed; CANOPY_SGLANG_PYTHON = an SGLang 0.5.x venv's
# python (the SGLang check is skipped, and reported, without it).
# Prints each check's output, then one summary line: `GPU CHECK: PASS` or `GPU CHECK: FAIL (<checks>)`.
#   bash scripts/gpu_check.sh            (from the repository root, with the project's venv)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
failed=()

check() {  # check NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "== $name (timeout ${seconds} s)"
    timeout --kill-after=10 "$seconds" "$@" || failed+=("$name")
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
check parallel 300 "$PY" scripts/gpu_check_parallel.py --timeout 140
check qwen3_5 240 "$PY" scripts/gpu_check_qwen3_5.py   # needs fla-core (a small pure-python wheel) beside CUDA torch
check parallel_qwen3_5 240 "$PY" scripts/gpu_check_parallel.py --family qwen3_5 --timeout 110
if [ -n "${CANOPY_SGLANG_PYTHON:-}" ]; then
    check sglang 300 env PYTHONPATH=. "$CANOPY_SGLANG_PYTHON" scripts/gpu_check_sglang.py --timeout 280
else
    echo "== sglang: skipped, CANOPY_SGLANG_PYTHON is not set"
    failed+=("sglang-not-run")
fi

if [ ${#failed[@]} -eq 0 ]; then
    echo "GPU CHECK: PASS"
else
    echo "GPU CHECK: FAIL (${failed[*]})"
    exit 1
fi
