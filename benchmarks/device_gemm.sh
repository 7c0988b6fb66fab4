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
# SASS: tensor-core instructions in each GEMM kernel's main loop, its instruction mix, and no
# local-memory traffic (LDL/STL) (benchmarks/sass_report.py; no GPU needed, so also run it locally).
python3 benchmarks/sass_report.py --match gemm_w12 --json "$OUT/sass.json" 2>&1 | tee "$OUT/sass_summary.txt" || true
# Every step under a time limit: a kernel that deadlocks must not eat the device budget.
# Smoke first (v4 on sm_90, v3, v2 and v1 against decode + F.linear on a few shapes), so a broken build stops early.
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/smoke.txt" || exit 1
import os, torch, w12
from w12 import cuda_ops
g = torch.Generator().manual_seed(0)
kernels = ["v4"] if torch.cuda.get_device_capability(0) == (9, 0) else []
for kern in kernels + ["v3", "v2", "v1"]:
    os.environ["W12_GEMM_KERNEL"] = kern
    for n, k, m in [(128, 64, 1), (4096, 4096, 1), (256, 14336, 16), (1000, 192, 64), (384, 1000, 33)]:
        wt = torch.randn(n, k, generator=g).to(torch.bfloat16)
        w = w12.pack(wt).to("cuda").with_layout(cuda_ops.preferred_layout("cuda"))
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
        y = w12.linear(x, w).float()
        ref = x.float() @ wt.cuda().float().t()
        err = float((y - ref).norm() / ref.norm())
        print(f"smoke {kern} n={n} k={k} m={m} rel err {err:.2e}", flush=True)
        assert err < 1e-2
PY
if [ "$MODE" != "benchonly" ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_gemm.py tests/test_gpu_gemm_v4.py -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
if [ "$MODE" = "quick" ]; then
  timeout 200 python3 benchmarks/bench_gemm.py --quick --json "$OUT/gemm_quick.json" "$@" 2>&1 | tee "$OUT/bench.txt"
else
  timeout 300 python3 benchmarks/bench_gemm.py --graph-set llama8b --json "$OUT/gemm_h200.json" "$@" 2>&1 | tee "$OUT/bench.txt"
fi
