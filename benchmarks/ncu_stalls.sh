#!/usr/bin/env bash
# Warp-stall breakdown of one W12 GEMM launch (the 5th of 8 on rotating cold weights) with ncu.
# Usage: benchmarks/ncu_stalls.sh N K M [kernel] [diag]   (kernel: auto, v1, v4; diag: W12_GEMM_DIAG)
# HOT=1: one weight copy and no cache flush (--cache-control none), so a weight smaller than L2
# is read from L2 (what the warps wait on when HBM is not the limit; bench_gemm.py --hot).
# Prints time, active cycles, instructions, tensor-pipe use and stall cycles per issued
# instruction by reason. Clocks are left as they are (--clock-control none).
set -o pipefail
cd "$(dirname "$0")/.."
N=$1 K=$2 M=$3 KERN=${4:-auto} DIAG=${5:-0}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
reasons="barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait"
metrics="gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg,smsp__inst_executed.sum,dram__bytes_read.sum,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.per_cycle_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__memory_throughput.avg.pct_of_peak_sustained_active"
for r in $reasons; do metrics="$metrics,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
# EXTRA_METRICS: a comma list appended (e.g. lts__throughput.avg.pct_of_peak_sustained_elapsed).
[ -n "$EXTRA_METRICS" ] && metrics="$metrics,$EXTRA_METRICS"
CACHE=all COPIES=4
[ "${HOT:-0}" = 1 ] && CACHE=none COPIES=1
echo "== ncu $KERN N=$N K=$K M=$M diag=$DIAG hot=${HOT:-0}"
W12_GEMM_KERNEL=$KERN W12_GEMM_DIAG=$DIAG PYTHONPATH=.:benchmarks $NCU --clock-control none --cache-control $CACHE \
  -k regex:gemm_w12 --launch-skip 4 --launch-count 1 --metrics "$metrics" \
  python3 benchmarks/_ncu_probe.py "$N" "$K" "$M" "$COPIES" 2>&1 |
  grep -E "gemm_w12|duration|cycles|inst_executed|bytes|warps_active|issue_active|pipe_tensor|wavefronts|throughput|stalled|pct|ERROR" |
  sed -e 's/smsp__average_warps_issue_stalled_//' -e 's/_per_issue_active.ratio//'
