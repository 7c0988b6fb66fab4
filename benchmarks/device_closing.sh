#!/usr/bin/env bash
# A session's closing device call: every GPU test on the final library, then the GEMM benchmark
# as issues 3 and 4 define it (auto = the default dispatch, v4 on sm_90 since session 10; every
# shape and M; the graph set) and the portable kernel v1 (SECOND=v1, the default; the M list
# SECOND_M, default 1,16,32,64, and the graph set), and with E2E=1 the e2e decode step at batch 1, two sides (three sides at batches 1
# and 8 spend ~4 min in torch.compile alone). BENCH=0 skips the tests and benchmarks (E2E alone). Results under $OUT, extras in $OUT/extra.tgz (the device
# tool returns at most 8 files). Session 8's run 5 ran it as device_s8_final.sh, with an 8-warp
# diagnostic step since dropped.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/log.txt" 2>&1
if [ "${BENCH:-1}" = 1 ]; then
timeout 200 python3 -m pytest -m gpu -q -rf --tb=short -p no:cacheprovider tests > "$OUT/gpu_tests.txt" 2>&1
tail -2 "$OUT/gpu_tests.txt"
B=benchmarks/bench_gemm.py
# Three captured graphs per measurement (session 42: captures of the same split-grid launches
# differ by up to 4 %; the README's figures use this command).
timeout 200 python3 $B --kernels auto --shapes llama8b,32b --m 1,2,4,8,16,32,64,128 --instances 3 --graph-set llama8b \
  --json "$OUT/gemm_h200.json" >> "$OUT/log.txt" 2>&1
SECOND=${SECOND:-v1}
timeout 150 python3 $B --kernels "$SECOND" --shapes llama8b,32b --m "${SECOND_M:-1,16,32,64}" --graph-set llama8b \
  --json "$OUT/gemm_h200_$SECOND.json" >> "$OUT/log.txt" 2>&1
grep -E "M=1:|M=16:|graph set" "$OUT/log.txt"
fi
if [ "${E2E:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/bench_e2e_hf.py --batches 1 --sides bf16,w12 --no-generate \
    --out "$OUT/e2e_hf_h200.json" > "$OUT/e2e.txt" 2>&1
  grep -v "it/s\]\|s/it\]" "$OUT/e2e.txt" | tail -8
fi
cd "$OUT" && tar czf extra.tgz ./*graph_set.json ./e2e.txt 2>/dev/null; rm -f ./*graph_set.json
