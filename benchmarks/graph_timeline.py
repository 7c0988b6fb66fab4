"""Kernel timeline of the decode-step graph set (bench_gemm.py --graph-set llama8b) without nsys.

Captures the 129 GEMMs of 32 Llama-3.1-8B layers + LM head at M = 1 in one CUDA graph (cuBLAS
BF16, then W12 with the current ``W12_GEMM_*`` settings), replays each a few times under
torch.profiler (CUPTI records every kernel a graph launches) and writes the GPU kernels as CSV
in the columns of ``nsys stats --report cuda_gpu_trace`` ("Start (ns)", "Duration (ns)",
"Name"), then runs benchmarks/nsys_gaps.py on it: per replay the span, busy and idle time, and
per layer position the GEMM time, reduce-kernel time and the gaps between them.

    PYTHONPATH=.:benchmarks python benchmarks/graph_timeline.py --out /tmp/timeline.csv
"""

from __future__ import annotations

import argparse
import csv

import torch
import torch.nn.functional as F  # noqa: N812
from bench_gemm import graph_set_inputs, in_kernel_layout, random_w12
from nsys_gaps import main as gaps_main
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import w12


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="CSV of the GPU kernels")
    ap.add_argument("--replays", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_timeline.py needs a CUDA GPU")
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    shapes, xs, wb = graph_set_inputs(gen)
    graphs = [capture(lambda: [F.linear(xs[w.shape[1]], w) for w in wb])]
    wv = [in_kernel_layout(random_w12(n, k, dev, gen)) for n, k in shapes]
    graphs.append(capture(lambda: [w12.linear(xs[w.K], w) for w in wv]))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for g in graphs:
            for _ in range(a.replays):
                g.replay()
                torch.cuda.synchronize()
                torch.cuda._sleep(1_000_000)  # an idle gap that separates the replays in the trace
                torch.cuda.synchronize()
    rows = [
        (e.start_ns(), e.duration_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA and not any(w in e.name().lower() for w in ("sleep", "spin_kernel"))
    ]
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Start (ns)", "Duration (ns)", "Name"])
        w.writerows(sorted(rows))
    print(f"wrote {len(rows)} kernels to {a.out}")
    return gaps_main([a.out])


if __name__ == "__main__":
    raise SystemExit(main())
