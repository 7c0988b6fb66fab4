#!/usr/bin/env bash
# One device call for the certified LM head: library check, GPU tests, benchmark, SASS excerpt.
# Usage on the device machine (repo root): OUT=/some/dir bash benchmarks/device_head.sh [PLANT_Z]
# Expects w12/_kernels/libw12.so built on the workstation (python csrc/build.py) and carried along;
# rebuilds it for sm_90a here only if that copy does not load.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/w12_head_out}
PLANT_Z=${1:-9.25}  # median top-logit z of Qwen2.5-Coder-1.5B on real prompts (bench_head.py --real)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import ctypes; ctypes.CDLL('w12/_kernels/libw12.so')" 2>"$OUT/load_error.txt"; then
  echo "carried libw12.so does not load here; rebuilding for sm_90a" | tee -a "$OUT/log.txt"
  W12_CUDA_ARCHS=90a python3 csrc/build.py 2>&1 | tail -5 | tee -a "$OUT/log.txt"
fi
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_head.py -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -15
echo "pytest rc=$?" | tee -a "$OUT/log.txt"
timeout 240 python3 benchmarks/bench_head.py --out "$OUT/head_h200.json" --plant-z "$PLANT_Z" 2>&1 | tee "$OUT/bench.txt"
echo "bench rc=$?" | tee -a "$OUT/log.txt"
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass w12/_kernels/libw12.so 2>/dev/null \
    | awk '/Function : .*head_screen_kernelILi1ELi8/{p=1;print;next} p&&/Function :/{exit} p{print}' > "$OUT/sass_screen_nt1.txt"
  echo "screen NT=1 SASS: $(grep -c 'LDG.*128' "$OUT/sass_screen_nt1.txt") 128-bit loads, $(grep -c IMMA "$OUT/sass_screen_nt1.txt") IMMA" \
    | tee -a "$OUT/log.txt"
fi
