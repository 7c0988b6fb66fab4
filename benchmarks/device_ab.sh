#!/usr/bin/env bash
# A/B of two kernel libraries in one device call: w12/_kernels (B, the change) and
# w12/_kernels/alt (A, the baseline; built with `python csrc/build.py --out w12/_kernels/alt`), or
# a baseline tree in .ab_alt/ (see below).
# Usage: benchmarks/device_ab.sh [tests|alltests] -- [bench_gemm args...] (tests: the GEMM GPU
# tests first; alltests: every GPU test); results in $OUT/ab.tgz (A_*.json, B_*.json).
# Runs A, B, A, B (AB_ROUNDS rounds, default 2) so that a drift of the GPU or of cuBLAS between the runs shows.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if [ "$1" = "tests" ] || [ "$1" = "alltests" ]; then
  what="tests/test_gpu_gemm.py tests/test_gpu_gemm_v4.py"
  [ "$1" = "alltests" ] && what=tests
  # shellcheck disable=SC2086  # two paths on purpose
  timeout 300 python3 -m pytest -q -m gpu $what -x -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/tests.txt"
  shift
fi
[ "$1" = "--" ] && shift
# A runs the baseline library under this tree's Python, or, where .ab_alt/ holds a baseline tree
# (its w12/ package with its library built into .ab_alt/w12/_kernels/, and its benchmarks/*.py;
# carried), the baseline's own Python and benchmark: for A/Bs across a GEMM ABI change
# (w12/cuda_ops.py refuses a library of another ABI).
if [ -f .ab_alt/benchmarks/bench_gemm.py ]; then A_BENCH=.ab_alt/benchmarks/bench_gemm.py A_LIB=; else
  A_BENCH=benchmarks/bench_gemm.py A_LIB=w12/_kernels/alt/libw12.so; fi
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  W12_KERNELS_LIB=$A_LIB timeout 250 python3 "$A_BENCH" --json "$OUT/A_$round.json" "$@" 2>&1 |
    grep -E "M=[0-9]+:|graph set|rror" | sed "s/^/A$round /"
  timeout 250 python3 benchmarks/bench_gemm.py --json "$OUT/B_$round.json" "$@" 2>&1 |
    grep -E "M=[0-9]+:|graph set|rror" | sed "s/^/B$round /"
done
# One archive: the device tool returns at most 8 files.
(cd "$OUT" && tar czf ab.tgz A_*.json B_*.json && rm -f A_*.json B_*.json)
