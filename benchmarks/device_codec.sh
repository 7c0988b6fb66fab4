#!/usr/bin/env bash
# One device call for the GPU codec: GPU tests, then the codec benchmark. Builds nothing: run
# `python csrc/build.py` here first and carry w12/_kernels with the call. Logs and JSON go to $OUT.
# Usage (on the device, from the repository root): bash benchmarks/device_codec.sh
set -o pipefail
OUT=${OUT:-/tmp/w12_codec_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
  ls -l w12/_kernels/
} 2>&1 | tee "$OUT/env.txt"

# SASS: no local-memory traffic (LDL/STL) in the codec kernels; wide loads/stores present.
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass w12/_kernels/libw12.so > /tmp/codec_sass.txt 2>&1
  python3 - <<'PY' 2>&1 | tee "$OUT/sass_summary.txt"
import re
funcs = re.split(r"\n\s*Function : ", open("/tmp/codec_sass.txt").read())
for f in funcs[1:]:
    name = f.split("\n", 1)[0]
    if "w12codec" not in name:
        continue
    keys = ("LDL", "STL", "LDG.E.128", "LDG.E.64", "STG.E.128", "ATOMS", "SHFL", "PRMT")
    print(name[-70:], {k: len(re.findall(re.escape(k), f)) for k in keys})
PY
fi

timeout 240 python3 -m pytest -m gpu tests/test_gpu_codec.py -q -p no:cacheprovider --durations=5 2>&1 \
  | tee "$OUT/pytest.txt"
rc_test=$?

timeout 240 python3 benchmarks/bench_codec.py --json "$OUT/codec_h200.json" "$@" 2>&1 | tee "$OUT/bench.txt"
rc_bench=$?

echo "pytest rc=$rc_test bench rc=$rc_bench"
exit $(( rc_test != 0 || rc_bench != 0 ))
