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

timeout 240 python3 -m pytest -m gpu tests/test_gpu_codec.py -q -p no:cacheprovider --durations=5 2>&1 \
  | tee "$OUT/pytest.txt"
rc_test=$?

timeout 240 python3 benchmarks/bench_codec.py --json "$OUT/codec_h200.json" "$@" 2>&1 | tee "$OUT/bench.txt"
rc_bench=$?

echo "pytest rc=$rc_test bench rc=$rc_bench"
exit $(( rc_test != 0 || rc_bench != 0 ))
