#!/usr/bin/env bash
# Warp-stall samples per SASS instruction of one W12 GEMM launch (the 5th of 8 on rotating cold
# weights), summarised by benchmarks/ncu_sass_stalls.py.
# Usage: benchmarks/ncu_sass.sh N K M [kernel] [diag] [out-prefix]   (kernel: auto, v1, v4)
# Writes PREFIX.csv.gz (ncu's source page) and PREFIX.txt (the summary, with the launch's time,
# SM clock, shared-memory configuration, registers, tensor-pipe and DRAM use). Clocks are left as
# they are (--clock-control none). Session 24 (docs/perf-notes.md) found v4's escape pass with it.
set -o pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "usage: $0 N K M [kernel] [diag] [out-prefix]   (N, K: the weight's shape; M: tokens)" >&2
  exit 2
fi
N=$1 K=$2 M=$3 KERN=${4:-auto} DIAG=${5:-0} PREFIX=${6:-ncu_sass_${N}x${K}_m${M}}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
metrics="launch__shared_mem_config_size,launch__occupancy_limit_shared_mem,launch__shared_mem_per_block_dynamic,launch__registers_per_thread,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_active.avg,smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active"
rep=$(mktemp -u /tmp/ncu_sass_XXXX)
W12_GEMM_KERNEL=$KERN W12_GEMM_DIAG=$DIAG PYTHONPATH=.:benchmarks $NCU --clock-control none --cache-control all \
  -k regex:gemm_w12 --launch-skip 4 --launch-count 1 --section WarpStateStats --section SourceCounters \
  --metrics "$metrics" -o "$rep" python3 benchmarks/_ncu_probe.py "$N" "$K" "$M" 4 > /dev/null 2>&1 || {
  echo "ncu failed for N=$N K=$K M=$M"; exit 1; }
{
  echo "== ncu $KERN N=$N K=$K M=$M diag=$DIAG"
  $NCU --import "$rep.ncu-rep" --page raw --csv --metrics "$metrics" 2>/dev/null |
    python3 -c 'import csv,sys; r=list(csv.reader(sys.stdin)); [print(f"  {h}: {v}") for h,v in zip(r[0],r[-1]) if "__" in h]'
  $NCU --import "$rep.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$PREFIX.csv.gz"
  python3 benchmarks/ncu_sass_stalls.py "$PREFIX.csv.gz" --top 20
} | tee "$PREFIX.txt"
rm -f "$rep.ncu-rep"
