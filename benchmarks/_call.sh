set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_gemm.py -x -p no:cacheprovider 2>&1 | tail -2
timeout 350 python3 benchmarks/bench_gemm.py --kernels v4 --shapes llama8b,32b --m 32,64,128 --diag 0,262144,1 --no-check --json $OUT/v4_pairs.json 2>&1 | grep -E '^\s*(qkv|o|gate_up|down|lm_head|32b)|geomean|rror' | head -90
