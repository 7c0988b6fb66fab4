#!/usr/bin/env bash
# One device call over the whole tree: every GPU test, then the end-to-end Transformers decode
# comparison in its cheapest honest form (eager step captured in a CUDA graph, both sides).
# The kernel library is built on the dev machine and carried as w12/_kernels.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
timeout "${E2E_TIMEOUT:-110}" python3 benchmarks/bench_e2e_hf.py --no-compile --uncompiled-graph --no-generate \
  --batches "${E2E_BATCHES:-1,8}" --new-tokens 32 --out "$OUT/e2e_hf_h200.json" 2>&1 | tail -30 | tee "$OUT/e2e.txt"
