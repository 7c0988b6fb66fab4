#!/usr/bin/env bash
# One device call for the W12 GEMM: GPU tests, SASS/resource check, benchmark. Logs and JSON go
# to $OUT (or ./device_out). Usage: benchmarks/device_gemm.sh [quick|full] [extra bench args...]
# The library is built on the dev machine (python csrc/build.py) and carried as w12/_kernels.
set -o pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
shift || true
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/env.txt"
# SASS: HMMA present, async copies (LDGSTS), no local-memory traffic (LDL/STL) in the GEMM kernels.
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass w12/_kernels/libw12.so > /tmp/sass.txt 2>&1
  python3 - <<'PY' 2>&1 | tee "$OUT/sass_summary.txt"
import re
txt = open("/tmp/sass.txt").read()
funcs = re.split(r"\n\s*Function : ", txt)
for f in funcs[1:]:
    name = f.split("\n", 1)[0]
    if "gemm_w12" not in name:
        continue
    c = {k: len(re.findall(k, f)) for k in ("HMMA", "LDGSTS", "LDS.128", "LDS.64", "LDL", "STL", "BAR.SYNC", "PRMT", "LOP3")}
    print(name[-60:], c)
PY
fi
if [ "$MODE" != "benchonly" ]; then
  python3 -m pytest -q -m gpu tests/test_gpu_gemm.py -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
if [ "$MODE" = "quick" ]; then
  python3 benchmarks/bench_gemm.py --quick --json "$OUT/gemm_quick.json" "$@" 2>&1 | tee "$OUT/bench.txt"
else
  python3 benchmarks/bench_gemm.py --graph-set llama8b --json "$OUT/gemm_h200.json" "$@" 2>&1 | tee "$OUT/bench.txt"
fi
