#!/usr/bin/env bash
# One device call over the whole tree: every GPU test (failures with their tracebacks), then the
# end-to-end Transformers decode comparison as the issue defines it (static cache,
# torch.compile(mode="reduce-overhead") on both sides, 512-token prompt, 256 new tokens) and
# generate() as users call it. The kernel library is built on the dev machine and carried as
# w12/_kernels. Each step has a time limit; partial e2e rows land in $OUT/*.partial.json.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider -p no:logging tests \
  > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"
grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.txt" | head -20
timeout "${E2E_TIMEOUT:-380}" python3 benchmarks/bench_e2e_hf.py --batches "${E2E_BATCHES:-1,8,32}" \
  --out "$OUT/e2e_hf_h200.json" > "$OUT/e2e.txt" 2>&1
grep -v "it/s\]\|s/it\]" "$OUT/e2e.txt" | tail -12
